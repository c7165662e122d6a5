"""`kvpilot bench vllm`: a real vLLM launched by kvpilot, its telemetry read back from the collector.

The bench starts a collector (SQLite in a temp dir) and, per round, two vLLMs on `kvpilot model init`'s
checkpoint of the engine bench's shape: one through kvpilot's launcher (iteration-detail log -> step rows,
OTLP spans -> request rows, /metrics -> a scrape target with a `node` label; an instance per round) and one
plain (none of that). In each round:

1. (first round) a mixed open-loop load, `kvpilot loadtest`'s `mixed` scenario and OpenAI client, streamed,
   on the wired vLLM;
2. alternating bursts on the two servers, the other one paused (the engine bench's quick requests as token
   ids, all at t=0, `ignore_eos`), best of each;
3. everything the wired vLLM was sent, read back from the collector (`vllm_readback`): request rows from
   spans against requests sent and against the increase of vLLM's own `vllm:request_success_total`
   (scraped), step rows against the iteration lines in its raw log, stage sums against e2e, series labels.

`observability_overhead` is 1 - the geometric mean over rounds of best(with) / best(without). Rounds restart
both servers because one vLLM process runs steadily 5-25% faster or slower than another of the same
config on this machine (measured: two plain servers, alternated) — far more than the 2% sought — so only
fresh pairs, started in alternating order, average that out; the per-round ratios are in the JSON.

With `wired` given (a vLLM someone else started through the launcher, e.g. the test session's), the bench
measures (1) and (3) on it and leaves the overhead out, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.engine_bench import bench_config, bench_workload, make_checkpoint
from benchmarks.vllm_readback import StageSums, Wired, series_labels, snapshot, stage_sums, stored_requests
from benchmarks.vllm_server import (
    STARTUP_TIMEOUT_S,
    PlainVllm,
    send_burst,
    server_args,
    server_env,
    signal_group,
    sigterm_as_exit,
    vllm_python_or_reason,
)
from engine import workload as W
from engine.config import EngineConfig
from kvpilot.loadtest.analysis import summarize
from kvpilot.loadtest.client import ClientOptions
from kvpilot.loadtest.plan import PlanOptions, plan_mixed
from kvpilot.loadtest.runner import RunOptions, run_load

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from collector.server import CollectorProcess
    from collector.settings import CollectorSettings

INSTANCE = "bench-vllm"
TOKEN = "bench-vllm-token"
SCRAPE_INTERVAL_S = 5.0  # more often than Prometheus' usual 15 s: the overhead measured is an upper bound
MAX_MODEL_LEN = 2048
OVERHEAD_LIMIT = 0.02


@dataclass(frozen=True)
class Shape:
    mixed_s: float  # the open-loop load's arrivals
    mixed_rate: float  # requests/s (Poisson)
    reps: int  # burst pairs (with, without) per round; 0 leaves the overhead out
    rounds: int = 1  # fresh server pairs
    max_total_tokens: int = MAX_MODEL_LEN - 16


QUICK = Shape(mixed_s=10.0, mixed_rate=3.0, reps=3, rounds=2)
FULL = Shape(mixed_s=30.0, mixed_rate=4.0, reps=4, rounds=4)


@dataclass
class Round:
    """What one wired vLLM was sent and what the collector stored of it; the bursts' tokens/s."""

    sent: int = 0
    stored: int = 0
    counted: float | None = None
    steps: int = 0
    lines: int = 0
    settled: bool = True
    stages: StageSums = field(default_factory=StageSums)
    with_tps: list[float] = field(default_factory=list)
    without_tps: list[float] = field(default_factory=list)
    startup_s: dict[str, float] = field(default_factory=dict)


def run_vllm_bench(
    quick: bool = False,
    *,
    vllm_python: str | None = None,
    progress: Callable[[str], None] | None = None,
    wired: Wired | None = None,
    shape: Shape | None = None,
) -> dict:
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    shape = shape or (QUICK if quick else FULL)
    if wired is not None:
        started = time.time()
        first, mixed = _round(wired, None, shape, say, mixed=True)
        result = _figures([first], mixed, series_labels(wired, since=started))
        result["observability_overhead_skipped"] = "an already running vLLM was given: the bench starts both itself"
        return {"benchmark": "vllm", "quick": quick, **result}
    python, reason = vllm_python_or_reason(vllm_python)
    if python is None:
        raise RuntimeError(f"bench vllm needs vLLM: {reason}")
    with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="kvpilot-bench-vllm-") as tmp:
        return {"benchmark": "vllm", "quick": quick, **_launch_and_measure(python, Path(tmp), shape, say)}


def bench_collector(tmp: Path) -> tuple[CollectorSettings, CollectorProcess]:
    """The bench's own collector on a fresh SQLite file: its ingest token, an admin token the launcher registers
    vLLM's /metrics with, loopback targets allowed; none of it taken from the caller's environment."""
    from collector.db import upgrade
    from collector.server import start_subprocess
    from kvpilot.vllm.workbench import local_collector_settings

    db_url = f"sqlite:///{tmp / 'kvpilot.db'}"
    upgrade(db_url)
    settings = local_collector_settings(db_url, ingest_token=TOKEN, scrape_timeout_s=2.0, sqlite_synchronous="FULL")
    return settings, start_subprocess(settings, log_path=tmp / "collector.log")


def _launch_and_measure(python: str, tmp: Path, shape: Shape, say: Callable[[str], None]) -> dict:
    from sqlalchemy import create_engine

    cfg = make_checkpoint(bench_config(True), tmp / "checkpoint")
    settings, collector = bench_collector(tmp)
    db = create_engine(settings.db_url)
    rounds: list[Round] = []
    mixed: dict | None = None
    labels: dict = {}
    admin = settings.admin_token
    try:
        for r in range(max(1, shape.rounds)):
            started = time.time()
            say(f"[round {r + 1}/{shape.rounds}] starting vLLM through kvpilot's launcher and a plain one")
            with _servers(python, cfg, tmp, r, collector.url, admin, db, wired_first=r % 2 == 0) as (
                wired,
                plain,
                ups,
            ):
                say(f"      served after {ups['with']:.0f} s (with) and {ups['without']:.0f} s (without)")
                one, load = _round(wired, plain, shape, say, mixed=r == 0)
                one.startup_s = ups
                if r == 0:
                    mixed, labels = load, series_labels(wired, since=started)
            rounds.append(one)
    finally:
        collector.stop()
        db.dispose()
    return _figures(rounds, mixed, labels)


@contextlib.contextmanager
def _servers(
    python: str,
    cfg: EngineConfig,
    tmp: Path,
    r: int,
    collector_url: str,
    admin_token: str | None,
    db: Engine,
    *,
    wired_first: bool,
) -> Iterator[tuple[Wired, PlainVllm, dict[str, float]]]:
    """A wired and a plain vLLM, started one after the other (order alternating by round), warm, paused."""
    from integrations.vllm import LaunchOptions, VllmLauncher
    from plumbing.process import free_port

    def args(port: int) -> list[str]:
        return server_args(
            Path(str(cfg.model.checkpoint)),
            port=port,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=cfg.cache.hot_bytes,
            max_num_seqs=cfg.scheduler.max_num_seqs,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        )

    instance = f"{INSTANCE}-{r + 1}"
    options = LaunchOptions(
        vllm_args=args(free_port()),
        python=python,
        collector_url=collector_url,
        ingest_token=TOKEN,
        admin_token=admin_token,
        instance=instance,
        run_id=f"{instance}-run",
        labels={"node": socket.gethostname()},
        scrape_interval_s=SCRAPE_INTERVAL_S,
        spool_dir=tmp / "spool",
        log_file=tmp / f"{instance}.log",
        env=server_env(),
    )
    port = free_port()
    launcher = VllmLauncher(options)
    plain = PlainVllm(python, args(port), port, tmp / f"vllm-plain-{r + 1}.log")
    ups: dict[str, float] = {}
    try:
        for name in ("with", "without") if wired_first else ("without", "with"):
            t0 = time.perf_counter()
            if name == "with":
                launcher.start().wait_ready(STARTUP_TIMEOUT_S)
                url = launcher.url
            else:
                url = plain.start().url
            ups[name] = round(time.perf_counter() - t0, 1)
            _warm(url)
            if name == "with" and launcher.proc is not None:
                signal_group(launcher.proc.pid, signal.SIGSTOP)
            else:
                plain.pause()
        pid = launcher.proc.pid if launcher.proc is not None else 0
        wired = Wired(
            url=launcher.url,
            model="bench",
            db=db,
            instance=instance,
            run_id=options.run_id or "",
            log_path=tmp / f"{instance}.log",
            pause=lambda: signal_group(pid, signal.SIGSTOP),
            resume=lambda: signal_group(pid, signal.SIGCONT),
        )
        wired.resume()
        yield wired, plain, ups
    finally:
        plain.stop()
        if launcher.proc is not None:
            signal_group(launcher.proc.pid, signal.SIGCONT)
        launcher.stop()


def _warm(url: str) -> None:
    reqs = bench_workload(True)[:16]
    send_burst(url, [W.prompt_ids(r, i) for i, r in enumerate(reqs)], [min(8, r.output_tokens) for r in reqs])


def _burst_requests(max_total: int) -> tuple[list[list[int]], list[int]]:
    """The engine bench's quick requests as token ids, prompts clipped to fit `max_total` with their output."""
    reqs = bench_workload(True)
    prompts = [W.prompt_ids(r, i)[: max(2, max_total - r.output_tokens)] for i, r in enumerate(reqs)]
    return prompts, [r.output_tokens for r in reqs]


def _mixed_load(w: Wired, shape: Shape, say: Callable[[str], None]) -> tuple[int, dict]:
    options = PlanOptions(
        duration_s=shape.mixed_s,
        rate=shape.mixed_rate,
        length_scale=8.0,
        output_scale=8.0,
        max_total_tokens=shape.max_total_tokens,
    )
    plan = plan_mixed(options)
    say(f"      mixed load: {len(plan)} requests over {shape.mixed_s:.0f} s (OpenAI API, streamed)")
    client = ClientOptions(api="openai", stream=True, timeout_s=300.0, model=w.model, run_id="bench-vllm")
    run = asyncio.run(run_load(w.url, plan, RunOptions(client=client, progress=False, scrape_interval_s=1.0)))
    ok = [r for r in run.results if r.outcome == "ok"]
    return len(run.results), {
        "requests": len(run.results),
        "answered": len(ok),
        "failed": len(run.results) - len(ok),
        "e2e_s": summarize([r.e2e_s for r in ok]),
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
    }


def _round(
    w: Wired, plain: PlainVllm | None, shape: Shape, say: Callable[[str], None], *, mixed: bool
) -> tuple[Round, dict | None]:
    before = snapshot(w, scraped_after=time.time())
    load_t0 = time.time()
    one = Round()
    summary = None
    if mixed:
        one.sent, summary = _mixed_load(w, shape, say)
    if plain is not None and shape.reps:
        prompts, max_tokens = _burst_requests(shape.max_total_tokens)
        for rep in range(shape.reps):
            for name in ("without", "with") if rep % 2 == 0 else ("with", "without"):
                (plain.resume if name == "without" else w.resume)()
                (w.pause if name == "without" else plain.pause)()
                burst = send_burst(w.url if name == "with" else plain.url, prompts, max_tokens, model=w.model)
                (one.with_tps if name == "with" else one.without_tps).append(round(burst.tokens_per_s, 1))
                one.sent += len(prompts) if name == "with" else 0
            say(f"      pair {rep + 1}/{shape.reps}: with {one.with_tps[-1]:.0f}, "
                f"without {one.without_tps[-1]:.0f} tokens/s")  # fmt: skip
        plain.pause()
        w.resume()
    after = snapshot(w, scraped_after=time.time() + 1.0, requests=one.sent, requests_since=load_t0 - 0.5)
    one.stored = stored_requests(w, since=load_t0 - 0.5)
    if after.vllm_count is not None and before.vllm_count is not None:
        one.counted = after.vllm_count - before.vllm_count
    one.steps, one.lines = after.steps - before.steps, after.lines - before.lines
    one.settled = before.settled and after.settled
    one.stages = stage_sums(w, since=load_t0 - 0.5, limit=one.sent + 1000)
    return one, summary


def _figures(rounds: list[Round], mixed: dict | None, labels: dict) -> dict:
    sent, stored = sum(r.sent for r in rounds), sum(r.stored for r in rounds)
    counted = None if any(r.counted is None for r in rounds) else round(sum(r.counted or 0.0 for r in rounds))
    steps, lines = sum(r.steps for r in rounds), sum(r.lines for r in rounds)
    stages = sum((r.stages for r in rounds), StageSums())
    paired = [r for r in rounds if r.with_tps and r.without_tps]
    overhead = _overhead([max(r.with_tps) / max(r.without_tps) for r in paired])
    return {
        "requests_sent": sent,
        "requests_stored": stored,
        "vllm_requests_total": counted,
        "steps_stored": steps,
        "iteration_lines": lines,
        "stage_sum_error": _r5(stages.max_error),
        "stage_sum": {
            "rows": stages.rows,
            "median_error": _r5(stages.median_error),
            "max_gap_s": _r5(stages.max_gap_s),
            "note": "e2e starts at the API server's arrival; queue, prefill and decode are the engine core's, so "
            "the gap is vLLM's input processing and output handoff, largest relative to the shortest requests",
        },
        "series_labels": labels,
        "observability_overhead": overhead,
        # the same from each round's medians: a second estimate, as noisy, for how far the first can be trusted
        "observability_overhead_medians": _overhead(
            [statistics.median(r.with_tps) / statistics.median(r.without_tps) for r in paired]
        ),
        "checks": {
            "stored_eq_sent_eq_vllm": stored == sent == counted,
            "steps_eq_iteration_lines": steps == lines,
            "overhead_within_limit": None if overhead is None else overhead <= OVERHEAD_LIMIT,
            "settled": all(r.settled for r in rounds),
        },
        "rounds": [
            {
                "with_tokens_per_s": r.with_tps,
                "without_tokens_per_s": r.without_tps,
                "best_ratio": round(max(r.with_tps) / max(r.without_tps), 4) if r.with_tps and r.without_tps else None,
                "startup_s": r.startup_s,
                "sent": r.sent,
                "stored": r.stored,
                "steps": r.steps,
            }
            for r in rounds
        ],
        "mixed_load": mixed,
        "scrape_interval_s": SCRAPE_INTERVAL_S,
    }


def _overhead(ratios: list[float]) -> float | None:
    """1 - the geometric mean of with/without throughput ratios."""
    return round(1.0 - math.prod(ratios) ** (1 / len(ratios)), 4) if ratios else None


def _r5(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(value, digits)
