"""`kvpilot sim calibrate`: fit the linear cost model to the real engine's steps.

The torch engine runs a grid of batch shapes (decode batches of 1..64 sequences at several context
lengths, prefills of several lengths, chunked prefills, mixed online traffic, and swap-heavy runs)
behind a recording executor. What the simulator must reproduce is the time from one step's end to the
next's — schedule, forward, sampling, bookkeeping and telemetry — so that is the target; after an idle
gap the step's own forward time plus the median bookkeeping overhead stands in. Coefficients are fitted
by non-negative least squares on error relative to the prediction (iteratively reweighted), after
dropping gross outliers (a descheduled process)."""

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
        # shape, t_in, t_out, exec, step id, time spent measuring the shape (not the engine's: left out)
        self.raw: list[tuple[StepShape, float, float, float, int, float]] = []
        self.recording = False

    @property
    def bytes_per_token(self) -> int:
        return self.inner.bytes_per_token

    def allocate_cache(self, hot_pages: int, cold_pages: int, page_tokens: int) -> None:
        self.inner.allocate_cache(hot_pages, cold_pages, page_tokens)

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> ExecuteResult:
        t_shape = time.perf_counter()
        shape = step_shape(out, kv, self.inner.page_tokens) if self.recording else None
        t_in = time.perf_counter()
        result = self.inner.execute(out, kv)
        t_out = time.perf_counter()
        if shape is not None:
            self.raw.append((shape, t_in, t_out, t_out - t_in, out.step, t_in - t_shape))
        return result

    def release(self, seq_ids: Iterable[int]) -> None:
        self.inner.release(seq_ids)

    def samples(self) -> list[Sample]:
        """Cycle times: previous step's end to this step's end when the steps were back to back, less the
        recorder's own time measuring the shape (an engine without the recorder does not spend it)."""
        cycles: list[tuple[StepShape, float | None, float]] = []
        prev_step, prev_out = None, 0.0
        for shape, _t_in, t_out, exec_s, step, recording_s in self.raw:
            back_to_back = prev_step is not None and step == prev_step + 1
            cycles.append((shape, t_out - prev_out - recording_s if back_to_back else None, exec_s))
            prev_step, prev_out = step, t_out
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
    decode_b = (1, 2, 4, 8, 16, 48) if quick else (1, 2, 4, 8, 16, 32, 64)
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
    n_mixed = 96 if quick else 128
    mix = {"scale": 4, "output_range": (16, 128)}
    runs.append(("mixed offline", lambda e, s, n=n_mixed: replay(e, W.mixed(n, seed=s, **mix), seed=s)))
    # Online traffic below, near and above saturation: the batch mixes the simulator meets most. Their
    # decode steps (ragged contexts, right after a prefill) run 5-15% slower than the grid's uniform
    # batches of the same size; a profile fitted without them under-predicted online replays by that much.
    for rate in (6.0, 12.0) if quick else (5.0, 10.0, 20.0):
        runs.append(
            (
                f"mixed rate={rate:g}",
                lambda e, s, n=n_mixed, r=rate: replay(e, W.mixed(n, seed=s, rate=r, **mix), seed=s),
            )
        )
    return runs


def _engine(cfg: EngineConfig) -> tuple[LLMEngine, RecordingExecutor]:
    rec = RecordingExecutor(TorchExecutor(cfg))
    engine = LLMEngine(cfg, executor=rec, clock=SkipClock(), sink=TrialSink())
    return engine, rec


class GridRunner:
    """The grid on the real engine: `warm_up()` runs it once unrecorded (oneDNN builds kernels per shape on
    first use), `measure()` records runs, all or some at a time, so that a caller can interleave its own
    work with the measurement (the sim bench spreads the grid between its real runs, so that the profile
    sees the machine at the speed those runs saw)."""

    def __init__(
        self, cfg: EngineConfig, *, quick: bool = False, progress: Callable[[str], None] | None = None
    ) -> None:
        self.runs = dict(grid(quick))
        self.engine, self.rec = _engine(cfg)
        swap_cfg = EngineConfig.from_dict(
            {
                **cfg.model_dump(mode="json"),
                "cache": {**cfg.cache.model_dump(mode="json"), "hot_bytes": 16 * 2**20, "enable_prefix_cache": False},
                "scheduler": {**cfg.scheduler.model_dump(mode="json"), "preemption_mode": "swap"},
            }
        )
        self.swap_engine, self.swap_rec = _engine(swap_cfg)
        swap_mix = W.mixed(24 if quick else 48, seed=3, scale=4, output_range=(32, 128))
        self.runs[SWAP_RUN] = lambda e, s: replay(e, swap_mix, seed=s)
        self.progress = progress

    @property
    def names(self) -> list[str]:
        return list(self.runs)

    @property
    def executor(self) -> TorchExecutor:
        return self.rec.inner

    def warm_up(self) -> None:
        # the real-time runs are skipped: the offline run already warmed their shapes up
        self._run([n for n in self.runs if not _real_time(n)], "warm-up", seed=1)

    def measure(self, names: Iterable[str] | None = None, *, seed: int = 2) -> None:
        """Record `names` (default: the whole grid); another `seed` gives the runs other prompts (a
        measured run repeated with the same seed would find its prompts in the prefix cache)."""
        self.rec.recording = self.swap_rec.recording = True
        try:
            self._run(list(self.runs) if names is None else list(names), "measure", seed=seed)
        finally:
            self.rec.recording = self.swap_rec.recording = False

    def samples(self) -> list[Sample]:
        return self.rec.samples() + self.swap_rec.samples()

    def clear(self) -> None:
        self.rec.raw.clear()
        self.swap_rec.raw.clear()

    def _run(self, names: list[str], phase: str, seed: int) -> None:
        for name in names:
            self.runs[name](self.swap_engine if name == SWAP_RUN else self.engine, seed)
            if self.progress is not None:
                self.progress(f"{phase}: {name}")


SWAP_RUN = "swap pressure"


def _real_time(name: str) -> bool:
    """Online traffic at a request rate (grid()'s "mixed rate=..."): it runs in real time, unwarmed."""
    return name.startswith("mixed rate=")


def grid_steps(quick: bool) -> int:
    """Progress steps of warm_up() and measure() over the whole grid."""
    names = [*(name for name, _ in grid(quick)), SWAP_RUN]
    return 2 * len(names) - sum(map(_real_time, names))


def collect(
    cfg: EngineConfig, *, quick: bool = False, progress: Callable[[str], None] | None = None
) -> tuple[list[Sample], list[str], TorchExecutor]:
    """Run the grid twice on the real engine (the first pass warms kernels up) and keep the second."""
    runner = GridRunner(cfg, quick=quick, progress=progress)
    runner.warm_up()
    runner.measure()
    return runner.samples(), runner.names, runner.executor


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


GROSS = 4.0  # a step this many times off its prediction waited for the OS, not for its batch (the
# calibration steps here stay within 0.5-2x of it)


def _design(samples: list[Sample]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array([[1.0, *(float(getattr(s.shape, f)) for f in LINEAR_FEATURES)] for s in samples])
    y = np.array([s.seconds for s in samples])
    return a, y


def fit(samples: list[Sample]) -> tuple[LinearCost, dict[str, float]]:
    """NNLS on relative error, iteratively reweighted: each step's error is taken relative to its
    prediction, not its measurement. Weighting by 1/measured gives the steps that happened to run slow
    less weight, which biased the fit low (it under-predicted its own calibration steps' total by 4%
    here). Only gross outliers are dropped: steps GROSS times slower or faster than predicted (the
    process was descheduled). Slow stretches short of that stay in: the simulator needs the mean step
    cost, and a robust, median-like fit makes every simulated request faster than the real ones."""
    if len(samples) < len(LINEAR_FEATURES) + 2:
        raise ValueError(f"need at least {len(LINEAR_FEATURES) + 2} steps to fit, got {len(samples)}")
    a, y = _design(samples)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    keep = np.ones(len(y), dtype=bool)
    coef = np.zeros(a.shape[1])
    denom = y
    for _ in range(6):
        w = 1.0 / denom[keep]
        coef = _nnls(a[keep] / scale * w[:, None], y[keep] * w) / scale
        denom = np.maximum(a @ coef, 0.1 * y.min())
        keep = (y < GROSS * denom) & (y * GROSS > denom)
    # goodness of fit over the kept steps (one dropped 1-second stall would swamp R^2)
    pred, y = (a @ coef)[keep], y[keep]
    rel = np.abs(pred - y) / y
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-30
    stats = {
        "samples": len(keep),
        "r2": 1.0 - ss_res / ss_tot,
        "mape": float(rel.mean()),
        "p90_abs_rel_error": float(np.quantile(rel, 0.9)),
        "dropped": int((~keep).sum()),
        "total_ratio": float(pred.sum() / y.sum()),  # predicted / measured time
    }
    named = {f: float(c) for f, c in zip(LINEAR_FEATURES, coef[1:], strict=True)}
    return LinearCost(c0_s=float(coef[0]), **named), stats


def fit_report(stats: dict[str, float], *, grid: list[str]) -> FitReport:
    """A profile's `fit` block: how well `fit` did (its stats), when, on which grid points."""
    return FitReport(
        samples=int(stats["samples"]),
        r2=round(stats["r2"], 4),
        mape=round(stats["mape"], 4),
        p90_abs_rel_error=round(stats["p90_abs_rel_error"], 4),
        calibrated_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        grid=grid,
    )


def jitter_quantiles(samples: list[Sample], coef: LinearCost, n: int = 41) -> list[float]:
    """`n` evenly spaced quantiles of measured / predicted step time (gross outliers left out, as the fit
    leaves them out), scaled so that their mean (the mean of the piecewise linear quantile function) is 1:
    drawing from them spreads steps around the model's mean without moving it."""
    a, y = _design(samples)
    pred = a @ np.array([coef.c0_s, *(getattr(coef, f) for f in LINEAR_FEATURES)])
    ratio = y / np.maximum(pred, 1e-12)
    ratio = ratio[(ratio < GROSS) & (ratio > 1 / GROSS)]
    if len(ratio) < n:
        raise ValueError(f"need at least {n} steps for the jitter quantiles, got {len(ratio)}")
    q = np.quantile(ratio, np.linspace(0.0, 1.0, n))
    mean = float(((q[:-1] + q[1:]) / 2).mean())
    return [round(float(v) / mean, 5) for v in q]


def cpu_name() -> str:
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
        description=f"calibrated on {cpu_name()} ({threads} torch threads, {os.cpu_count()} CPUs) with "
        f"`kvpilot sim calibrate{' --quick' if quick else ''}`",
        hardware=HardwareSpec(
            name=cpu_name(), kind=executor.device if executor.device == "cpu" else "gpu", threads=threads
        ),
        model=ModelProfile(
            name=f"llama-d{cfg.model.dim}-l{cfg.model.n_layers}",
            config=executor.model_cfg,
            params=params,
            weights_bytes=weights,
            kv_bytes_per_token=executor.bytes_per_token,
        ),
        linear=coef,
        step_jitter=jitter_quantiles(samples, coef),
        engine_defaults=defaults,
        fit=fit_report(stats, grid=grid_names),
    )
