"""`kvpilot bench vllm`: a real vLLM launched by kvpilot, its telemetry read back from the collector.

The bench starts a collector (SQLite in a temp dir), one vLLM through kvpilot's launcher (iteration-detail
log -> step rows, OTLP spans -> request rows, /metrics -> a scrape target with a `node` label) and one plain
vLLM (none of that), both on `kvpilot model init`'s checkpoint of the engine bench's shape. Then:

1. a mixed open-loop load (`kvpilot loadtest`'s `mixed` scenario and OpenAI client, streamed) on the wired
   vLLM, and everything read back from the collector (`vllm_readback`): requests stored from spans against
   requests sent and against vLLM's own `vllm:request_success_total` increase (scraped), step rows against
   the iteration lines in vLLM's raw log, the stage timings' sum against e2e, the labels of scraped series;
2. `observability_overhead`: 1 - best/best of the two servers' throughput on the same burst (the engine
   bench's quick requests, token ids, all at t=0, `ignore_eos`), the two measured alternately with the
   other paused, best of each, since a shared 2-core machine slows whichever run it hits. The bursts sent to
   the wired vLLM count in (1) as well.

With `wired` given (a vLLM someone else started through the launcher, e.g. the test session's), the bench
measures (1) on it and leaves the overhead out, saying why.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.engine_bench import bench_config, bench_workload, make_checkpoint
from benchmarks.vllm_readback import (
    Wired,
    series_labels,
    snapshot,
    stage_sums,
    stored_requests,
)
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
from kvpilot.loadtest.analysis import summarize
from kvpilot.loadtest.client import ClientOptions
from kvpilot.loadtest.plan import PlanOptions, plan_mixed
from kvpilot.loadtest.runner import RunOptions, run_load

INSTANCE = "bench-vllm"
TOKEN = "bench-vllm-token"
SCRAPE_INTERVAL_S = 5.0  # more often than Prometheus' usual 15 s: the overhead measured is an upper bound
MAX_MODEL_LEN = 2048
OVERHEAD_LIMIT = 0.02


@dataclass(frozen=True)
class Shape:
    mixed_s: float  # the open-loop load's arrivals
    mixed_rate: float  # requests/s (Poisson)
    reps: int  # burst pairs (with, without) for the overhead; 0 leaves it out
    max_total_tokens: int = MAX_MODEL_LEN - 16


QUICK = Shape(mixed_s=10.0, mixed_rate=3.0, reps=4)
FULL = Shape(mixed_s=30.0, mixed_rate=4.0, reps=8)


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
        result = _measure(wired, None, shape, say)
        result["observability_overhead_skipped"] = "an already running vLLM was given: the bench starts both itself"
        return {"benchmark": "vllm", "quick": quick, **result}
    python, reason = vllm_python_or_reason(vllm_python)
    if python is None:
        raise RuntimeError(f"bench vllm needs vLLM: {reason}")
    with sigterm_as_exit(), tempfile.TemporaryDirectory(prefix="kvpilot-bench-vllm-") as tmp:
        return {"benchmark": "vllm", "quick": quick, **_launch_and_measure(python, Path(tmp), shape, say)}


def _launch_and_measure(python: str, tmp: Path, shape: Shape, say: Callable[[str], None]) -> dict:
    from sqlalchemy import create_engine

    from collector.db import upgrade
    from collector.server import free_port, start_subprocess
    from collector.settings import CollectorSettings
    from kvpilot.vllm import LaunchOptions, VllmLauncher

    cfg = make_checkpoint(bench_config(True), tmp / "checkpoint")
    db_url = f"sqlite:///{tmp / 'kvpilot.db'}"
    upgrade(db_url)
    settings = CollectorSettings(
        db_url=db_url, ingest_token=TOKEN, port=free_port(), log_level="warning", scrape_timeout_s=2.0
    )
    collector = start_subprocess(settings, log_path=tmp / "collector.log")
    db = create_engine(db_url)
    launcher = plain = None
    try:

        def args(port: int) -> list[str]:
            return server_args(
                Path(str(cfg.model.checkpoint)),
                port=port,
                max_model_len=MAX_MODEL_LEN,
                kv_cache_bytes=cfg.cache.hot_bytes,
                max_num_seqs=cfg.scheduler.max_num_seqs,
                max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            )

        say("[1/4] starting vLLM through kvpilot's launcher (steps, spans, scrape -> the collector)")
        t0 = time.perf_counter()
        options = LaunchOptions(
            vllm_args=args(free_port()),
            python=python,
            collector_url=f"http://127.0.0.1:{settings.port}",
            ingest_token=TOKEN,
            instance=INSTANCE,
            run_id="bench-vllm",
            labels={"node": socket.gethostname()},
            scrape_interval_s=SCRAPE_INTERVAL_S,
            spool_dir=tmp / "spool",
            log_file=tmp / "vllm-wired.log",
            env=server_env(),
        )
        launcher = VllmLauncher(options).start()
        launcher.wait_ready(STARTUP_TIMEOUT_S)
        startup_with = time.perf_counter() - t0
        pid = launcher.proc.pid if launcher.proc is not None else 0
        wired = Wired(
            url=launcher.url,
            model="bench",
            db=db,
            instance=INSTANCE,
            run_id=launcher.run_id,
            log_path=tmp / "vllm-wired.log",
            pause=lambda: signal_group(pid, signal.SIGSTOP),
            resume=lambda: signal_group(pid, signal.SIGCONT),
        )
        _warm(wired.url)
        wired.pause()
        say(f"      served after {startup_with:.0f} s; [2/4] starting a plain vLLM (no kvpilot) to compare with")
        port = free_port()
        plain = PlainVllm(python, args(port), port, tmp / "vllm-plain.log").start()
        _warm(plain.url)
        plain.pause()
        say(f"      served after {plain.startup_s:.0f} s")
        wired.resume()
        result = _measure(wired, plain, shape, say)
        result["startup_s"] = {"with": round(startup_with, 1), "without": round(plain.startup_s or 0.0, 1)}
        return result
    finally:
        if plain is not None:
            plain.stop()
        if launcher is not None:
            signal_group(launcher.proc.pid if launcher.proc else 0, signal.SIGCONT)
            launcher.stop()
        collector.stop()
        db.dispose()


def _warm(url: str) -> None:
    reqs = bench_workload(True)[:16]
    send_burst(url, [W.prompt_ids(r, i) for i, r in enumerate(reqs)], [min(8, r.output_tokens) for r in reqs])


def _burst_requests(max_total: int) -> tuple[list[list[int]], list[int]]:
    """The engine bench's quick requests as token ids, prompts clipped to fit `max_total` with their output."""
    reqs = bench_workload(True)
    prompts = [W.prompt_ids(r, i)[: max(2, max_total - r.output_tokens)] for i, r in enumerate(reqs)]
    return prompts, [r.output_tokens for r in reqs]


def _measure(w: Wired, plain: PlainVllm | None, shape: Shape, say: Callable[[str], None]) -> dict:
    started = time.time()
    before = snapshot(w, scraped_after=time.time())
    load_t0 = time.time()
    plan = plan_mixed(
        PlanOptions(
            duration_s=shape.mixed_s,
            rate=shape.mixed_rate,
            length_scale=8.0,
            output_scale=8.0,
            max_total_tokens=shape.max_total_tokens,
        )
    )
    say(f"[3/4] mixed load: {len(plan)} requests over {shape.mixed_s:.0f} s (OpenAI API, streamed)")
    client = ClientOptions(api="openai", stream=True, timeout_s=300.0, model=w.model, run_id="bench-vllm")
    run = asyncio.run(run_load(w.url, plan, RunOptions(client=client, progress=False, scrape_interval_s=1.0)))
    sent = len(run.results)
    throughput: dict[str, list[float]] = {"with": [], "without": []}
    if plain is not None and shape.reps:
        prompts, max_tokens = _burst_requests(shape.max_total_tokens)
        say(f"[4/4] throughput with and without kvpilot's telemetry: {shape.reps} alternating pairs of bursts")
        for rep in range(shape.reps):
            order = ("without", "with") if rep % 2 == 0 else ("with", "without")
            for name in order:
                url = w.url if name == "with" else plain.url
                (plain.resume if name == "without" else w.resume)()
                (w.pause if name == "without" else plain.pause)()
                burst = send_burst(url, prompts, max_tokens, model=w.model)
                throughput[name].append(round(burst.tokens_per_s, 1))
                sent += len(prompts) if name == "with" else 0
            say(f"      pair {rep + 1}/{shape.reps}: with {throughput['with'][-1]:.0f}, "
                f"without {throughput['without'][-1]:.0f} tokens/s")  # fmt: skip
        plain.pause()
        w.resume()
    after = snapshot(w, scraped_after=time.time() + 1.0, requests=sent, requests_since=load_t0 - 0.5)
    sums = stage_sums(w, since=load_t0 - 0.5, limit=sent + 1000)
    stored = stored_requests(w, since=load_t0 - 0.5)
    counted = (
        after.vllm_count - before.vllm_count if after.vllm_count is not None and before.vllm_count is not None else None
    )
    ok = [r for r in run.results if r.outcome == "ok"]
    overhead = None
    if throughput["with"] and throughput["without"]:
        overhead = round(1.0 - max(throughput["with"]) / max(throughput["without"]), 4)
    return {
        "requests_sent": sent,
        "requests_stored": stored,
        "vllm_requests_total": None if counted is None else round(counted),
        "steps_stored": after.steps - before.steps,
        "iteration_lines": after.lines - before.lines,
        "stage_sum_error": _round(sums.max_error),
        "stage_sum": {
            "rows": sums.rows,
            "median_error": _round(sums.median_error),
            "max_gap_s": _round(sums.max_gap_s),
            "note": "e2e starts at the API server's arrival; queue, prefill and decode are the engine core's, so "
            "the gap is vLLM's input processing and output handoff, largest relative to the shortest requests",
        },
        "series_labels": series_labels(w, since=started),
        "observability_overhead": overhead,
        "checks": {
            "stored_eq_sent_eq_vllm": stored == sent == counted,
            "steps_eq_iteration_lines": after.steps - before.steps == after.lines - before.lines,
            "overhead_within_limit": None if overhead is None else overhead <= OVERHEAD_LIMIT,
            "settled": before.settled and after.settled,
        },
        "throughput_tokens_per_s": {
            "with": max(throughput["with"], default=None),
            "without": max(throughput["without"], default=None),
            "reps": throughput,
            "median_ratio": (
                round(statistics.median(throughput["with"]) / statistics.median(throughput["without"]), 4)
                if throughput["with"]
                else None
            ),
        },
        "mixed_load": {
            "requests": len(run.results),
            "answered": len(ok),
            "failed": len(run.results) - len(ok),
            "e2e_s": summarize([r.e2e_s for r in ok]),
            "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        },
        "scrape_interval_s": SCRAPE_INTERVAL_S,
        "instance": w.instance,
        "run_id": w.run_id,
    }


def _round(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(value, digits)
