"""How well the simulator in vLLM's mode predicts the real vLLM: every live replay of a run, re-run in the
simulator (same config, same seed, steps drawn from the calibration's spread) and compared.

Per replay: throughput (output tokens/s over the replay's window), busy time (the summed iteration elapsed time
vLLM logged in the window against the simulator's summed forward time — what the cost model predicts) and p99
end-to-end latency and TTFT. Errors are relative to the real figure. Replays of the config the cost model was
fitted on are in-sample; every other config is out of sample.
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine

from collector.queries import stored_steps
from engine import workload as W
from tuner.metrics import SLO
from tuner.vllm.calibrate import VllmProfile
from tuner.vllm.config import VllmConfig
from tuner.vllm.sim import VllmSimBackend

METRICS = ("throughput", "busy", "e2e_p99", "ttft_p99")


def _err(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real <= 0:
        return None
    return abs(sim - real) / real


def compare(
    evaluations: Sequence[dict[str, Any]],
    profile: VllmProfile,
    workload: Callable[[int], list[W.WorkloadRequest]],
    db: Engine,
    slo: SLO,
    *,
    calibrated_on: VllmConfig | None = None,
) -> dict[str, Any]:
    """Simulate each recorded live replay (`VllmBackend.evaluations`) and return per-replay rows and the summary."""
    sim = VllmSimBackend(profile, workload, db, slo, instance="tuner-vllm-fidelity", jitter=True)
    rows = []
    for ev in evaluations:
        cfg: VllmConfig = ev["config"]
        real = ev["metrics"]
        steps = stored_steps(db, start=ev["start"], end=ev["end"], run_ids=[ev["run_id"]])
        real_busy = sum(s.duration_s for s in steps)
        m = sim.evaluate(cfg, run_id=f"fidelity-{uuid.uuid4().hex[:8]}", seed=ev["seed"])
        row = {
            "run_id": ev["run_id"],
            "seed": ev["seed"],
            "changed": {k: b for k, _a, b in (calibrated_on or cfg).changed(cfg)},
            "in_sample": calibrated_on is not None and cfg.to_args() == calibrated_on.to_args(),
            "real": {
                "throughput": real.throughput_tps,
                "busy": real_busy,
                "e2e_p99": real.e2e_p99_s,
                "ttft_p99": real.ttft_p99_s,
                "steps": len(steps),
            },
            "sim": {
                "throughput": m.throughput_tps,
                "busy": sim.last_busy_s,
                "e2e_p99": m.e2e_p99_s,
                "ttft_p99": m.ttft_p99_s,
                "steps": sim.last_replay.steps if sim.last_replay else None,
            },
        }
        row["error"] = {k: _err(row["sim"][k], row["real"][k]) for k in METRICS}
        rows.append(row)
    return {"replays": rows, "summary": summarize(rows)}


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scope, keep in (("all", lambda r: True), ("out_of_sample", lambda r: not r["in_sample"])):
        chosen = [r for r in rows if keep(r)]
        out[scope] = {"replays": len(chosen)}
        for k in METRICS:
            errs = [r["error"][k] for r in chosen if r["error"][k] is not None]
            out[scope][k] = {"max": max(errs), "median": statistics.median(errs)} if errs else None
    return out
