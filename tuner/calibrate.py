"""`kvpilot sim calibrate`: fit the linear cost model to the real engine's steps.

The torch engine runs a grid of batch shapes (decode batches of 1..64 sequences at several context
lengths, prefills of several lengths, chunked prefills, mixed online traffic, and swap-heavy runs)
behind a recording executor. What the simulator must reproduce is the time from one step's end to the
next's — schedule, forward, sampling, bookkeeping and telemetry — so that is the target; after an idle
gap the step's own forward time plus the median bookkeeping overhead stands in. Coefficients are fitted
by non-negative least squares on relative error, after dropping gross outliers (a noisy neighbour).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import workload as W
from engine.config import EngineConfig
from engine.executor import ExecuteResult, TorchExecutor
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from tuner.profile import LINEAR_FEATURES, CostProfile, FitReport, HardwareSpec, LinearCost, ModelProfile, StepShape
from tuner.replay import SkipClock, TrialSink, replay
from tuner.sim import step_shape

if TYPE_CHECKING:
    from engine.kv import KVCacheManager
    from engine.scheduler import SchedulerOutput

log = logging.getLogger("kvpilot.tuner.calibrate")

CPU_CONFIG = {
    "device": "cpu",
    "model": {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "ffn_dim": 688, "seed": 0},
    "cache": {"hot_bytes": 64 * 2**20, "cold_bytes": 128 * 2**20},
    "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "queue_limit": 4096},
    "warmup": {"requests": 0},
    "telemetry": {"sink": "memory", "trace_alloc": True},
}


@dataclass(frozen=True)
class Sample:
    shape: StepShape
    seconds: float


class RecordingExecutor:
    """Wraps the torch executor; records each step's shape and its end-to-end cycle time."""

    def __init__(self, inner: TorchExecutor) -> None:
        self.inner = inner
        self.model_cfg = inner.model_cfg
        self.device = inner.device
        self.raw: list[tuple[StepShape, float, float, float, int]] = []  # shape, t_in, t_out, exec, step id
        self.recording = False

    @property
    def bytes_per_token(self) -> int:
        return self.inner.bytes_per_token

    def allocate_cache(self, hot_pages: int, cold_pages: int, page_tokens: int) -> None:
        self.inner.allocate_cache(hot_pages, cold_pages, page_tokens)

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> ExecuteResult:
        shape = step_shape(out, kv, self.inner.page_tokens) if self.recording else None
        t_in = time.perf_counter()
        result = self.inner.execute(out, kv)
        t_out = time.perf_counter()
        if shape is not None:
            self.raw.append((shape, t_in, t_out, t_out - t_in, out.step))
        return result

    def release(self, seq_ids: Iterable[int]) -> None:
        self.inner.release(seq_ids)

    def samples(self) -> list[Sample]:
        """Cycle times: previous step's end to this step's end when the steps were back to back."""
        cycles: list[tuple[StepShape, float | None, float]] = []
        prev = None
        for shape, t_in, t_out, exec_s, step in self.raw:
            back_to_back = prev is not None and step == prev[4] + 1
            cycles.append((shape, t_out - prev[2] if back_to_back else None, exec_s))
            prev = (shape, t_in, t_out, exec_s, step)
        overheads = [c - e for _, c, e in cycles if c is not None]
        overhead = statistics.median(overheads) if overheads else 0.0
        return [Sample(s, c if c is not None else e + overhead) for s, c, e in cycles]


def _batch(engine: LLMEngine, batch: int, prompt: int, max_tokens: int, seed: int) -> None:
    for i in range(batch):
        req = W.WorkloadRequest(0.0, prompt, max_tokens)
        engine.add_request(W.prompt_ids(req, i, seed=seed), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.run_until_done()


def grid(quick: bool) -> list[tuple[str, Callable[[LLMEngine, int], None]]]:
    """Named runs that cover the batch shapes the simulator will meet."""
    decode_b = (1, 4, 16, 48) if quick else (1, 2, 4, 8, 16, 32, 64)
    decode_l = (32, 512) if quick else (32, 256, 1024, 2048)
    prefill_l = (128, 1024) if quick else (64, 256, 1024, 2048)
    runs: list[tuple[str, Callable[[LLMEngine, int], None]]] = []
    for b in decode_b:
        for length in decode_l:
            steps = 6 if quick else 12
            runs.append((f"decode b={b} ctx={length}", lambda e, s, b=b, n=length, k=steps: _batch(e, b, n, k, s)))
    for b in (1, 4):
        for length in prefill_l:
            runs.append((f"prefill b={b} len={length}", lambda e, s, b=b, n=length: _batch(e, b, n, 2, s)))
    n_mixed = 48 if quick else 128
    mix = {"scale": 4, "output_range": (16, 128)}
    runs.append(("mixed offline", lambda e, s, n=n_mixed: replay(e, W.mixed(n, seed=s, **mix), seed=s)))
    # Online traffic below, near and above saturation: the batch mixes the simulator meets most.
    for rate in (8.0,) if quick else (5.0, 10.0, 20.0):
        runs.append((f"mixed rate={rate:g}",
                     lambda e, s, n=n_mixed, r=rate: replay(e, W.mixed(n, seed=s, rate=r, **mix), seed=s)))
    return runs


def _engine(cfg: EngineConfig) -> tuple[LLMEngine, RecordingExecutor]:
    rec = RecordingExecutor(TorchExecutor(cfg))
    engine = LLMEngine(cfg, executor=rec, clock=SkipClock(), sink=TrialSink())
    return engine, rec


def collect(cfg: EngineConfig, *, quick: bool = False, progress: Callable[[str], None] | None = None
            ) -> tuple[list[Sample], list[str], TorchExecutor]:
    """Run the grid twice on the real engine (the first pass warms kernels up) and keep the second."""
    runs = grid(quick)
    engine, rec = _engine(cfg)
    swap_cfg = EngineConfig.from_dict({
        **cfg.model_dump(mode="json"),
        "cache": {**cfg.cache.model_dump(mode="json"), "hot_bytes": 16 * 2**20, "enable_prefix_cache": False},
        "scheduler": {**cfg.scheduler.model_dump(mode="json"), "preemption_mode": "swap"},
    })
    swap_engine, swap_rec = _engine(swap_cfg)
    swap_mix = W.mixed(24 if quick else 48, seed=3, scale=4, output_range=(32, 128))
    swap_run = ("swap pressure", lambda e, s: replay(e, swap_mix, seed=s))
    total = 2 * (len(runs) + 1) - sum(name.startswith("mixed rate") for name, _ in runs)
    done = 0
    for phase in ("warm-up", "measure"):
        rec.recording = swap_rec.recording = phase == "measure"
        for name, run in [*runs, swap_run]:
            if phase == "warm-up" and name.startswith("mixed rate"):
                continue  # real-time runs; the offline run already warmed these shapes up
            target = swap_engine if name == "swap pressure" else engine
            run(target, 1 if phase == "warm-up" else 2)
            done += 1
            if progress is not None:
                progress(f"{phase}: {name} ({done}/{total})")
    samples = rec.samples() + swap_rec.samples()
    return samples, [name for name, _ in runs] + [swap_run[0]], rec.inner


def _nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """Lawson-Hanson non-negative least squares (numpy only)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
        w = a.T @ (b - a @ x)
    return x


def _design(samples: list[Sample]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array([[1.0, *(float(getattr(s.shape, f)) for f in LINEAR_FEATURES)] for s in samples])
    y = np.array([s.seconds for s in samples])
    return a, y


def fit(samples: list[Sample]) -> tuple[LinearCost, dict[str, float]]:
    """NNLS on relative error; steps more than 6 robust sigmas off (a step that waited for a noisy
    neighbour) are dropped and the fit repeated. No further down-weighting: the simulator needs the mean
    step cost (a robust, median-like fit makes every simulated request faster than the real ones)."""
    if len(samples) < len(LINEAR_FEATURES) + 2:
        raise ValueError(f"need at least {len(LINEAR_FEATURES) + 2} steps to fit, got {len(samples)}")
    a, y = _design(samples)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    keep = np.ones(len(y), dtype=bool)
    coef = np.zeros(a.shape[1])
    for _ in range(3):
        w = 1.0 / y[keep]
        coef = _nnls(a[keep] / scale * w[:, None], y[keep] * w) / scale
        rel = (a @ coef - y) / y
        sigma = float(np.median(np.abs(rel - np.median(rel)))) * 1.4826 or 1e-9
        keep = np.abs(rel - np.median(rel)) <= 6 * sigma
    pred = a @ coef
    rel = np.abs(pred - y) / y
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-30
    stats = {
        "samples": len(y),
        "r2": 1.0 - ss_res / ss_tot,
        "mape": float(rel.mean()),
        "p90_abs_rel_error": float(np.quantile(rel, 0.9)),
        "dropped": int((~keep).sum()),
    }
    named = {f: float(c) for f, c in zip(LINEAR_FEATURES, coef[1:], strict=True)}
    return LinearCost(c0_s=float(coef[0]), **named), stats


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(
    *,
    name: str = "cpu-2core",
    config: EngineConfig | None = None,
    quick: bool = False,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> CostProfile:
    """Run the grid on the torch engine and return the fitted profile (not yet saved).

    `threads` sets torch's intra-op threads for the run (recorded in the profile; replays against the
    profile use the same). On a CPU shared with other work, 1 thread is far steadier: with 2, one
    preempted OpenMP worker stalls every matmul barrier (p90 step time 10-50x the median here)."""
    cfg = config or EngineConfig.from_dict(CPU_CONFIG)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    samples, grid_names, executor = collect(cfg, quick=quick, progress=progress)
    coef, stats = fit(samples)
    log.info("calibration fit: %s", stats)
    model = executor.model
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    threads = torch.get_num_threads()
    defaults = cfg.model_dump(mode="json", include={"device", "cache", "scheduler", "recycler"})
    return CostProfile(
        name=name,
        kind="linear",
        description=f"calibrated on {_cpu_name()} ({threads} torch threads, {os.cpu_count()} CPUs) with "
        f"`kvpilot sim calibrate{' --quick' if quick else ''}`",
        hardware=HardwareSpec(name=_cpu_name(), kind=executor.device if executor.device == "cpu" else "gpu",
                              threads=threads),
        model=ModelProfile(
            name=f"llama-d{cfg.model.dim}-l{cfg.model.n_layers}",
            config=executor.model_cfg,
            params=params,
            weights_bytes=weights,
            kv_bytes_per_token=executor.bytes_per_token,
        ),
        linear=coef,
        engine_defaults=defaults,
        fit=FitReport(
            samples=int(stats["samples"]),
            r2=round(stats["r2"], 4),
            mape=round(stats["mape"], 4),
            p90_abs_rel_error=round(stats["p90_abs_rel_error"], 4),
            calibrated_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            grid=grid_names,
        ),
    )
