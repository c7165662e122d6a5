"""Three vantage points on one real vLLM under bursts: a light client, vLLM's frontend histograms, stored rows.

`python -m benchmarks.user_latency --work DIR` starts a collector (`kvpilot.vllm.workbench`) and a vLLM through
`kvpilot vllm serve`'s launcher (CPU build, the tiny checkpoint, 16 MiB of KV), replays a trace of bursts
whose prompts share a few long prefixes, and prints, side by side, the TTFT and e2e p50/p99 of:

- the client: `benchmarks.light_client` on the same host, streaming (its own lag kept small: bytes prepared,
  connections opened ahead); TTFT at the first chunk with text;
- vLLM's frontend histograms (`vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`,
  `vllm:request_queue_time_seconds`), the run's increase, at bucket precision;
- the stored request rows: `collector.queries.headline_latency` (user-facing: from the HTTP arrival) and the
  spans' own view (from vLLM's `arrival_time`), with the stage before the engine alone.

`measure` is what tests/vllm drives against the session's vLLM. The load average is printed with the figures:
on a shared host the client's own lag is part of what it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine

from benchmarks.asgi.kvpilot_bench_timing import BENCH_TIMING_ENV
from benchmarks.light_client import ClientTiming, TraceRequest, replay, shared_prefix_trace
from collector import queries
from collector.histograms import bucket_quantile, parse_le
from collector.scraper import parse_exposition
from plumbing.percentile import nearest_rank

HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
}
SPAN_WAIT_S = 60.0  # vLLM's span processor exports every 5 s; the collector stores each export at once


def _histograms(text: str) -> dict[str, dict[float, float]]:
    """family -> le -> cumulative count, summed over label sets."""
    wanted = {f + "_bucket": k for k, f in HISTOGRAMS.items()}
    out: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for name, labels, value in parse_exposition(text):
        if name in wanted and "le" in labels:
            out[wanted[name]][parse_le(labels["le"])] += value
    return out


def histogram_view(before: str, after: str) -> dict[str, dict[str, float | None]]:
    """p50/p99 of each frontend histogram's increase between two scrapes (Prometheus's histogram_quantile)."""
    b, a = _histograms(before), _histograms(after)
    out = {}
    for key in HISTOGRAMS:
        buckets = sorted((le, a[key][le] - b.get(key, {}).get(le, 0.0)) for le in a.get(key, {}))
        total = buckets[-1][1] if buckets else 0.0
        out[key] = {
            "p50": bucket_quantile(0.5, buckets) if total else None,
            "p99": bucket_quantile(0.99, buckets) if total else None,
        }
    return out


def _pair(values: list[float]) -> dict[str, float | None]:
    return {"p50": nearest_rank(values, 0.5), "p99": nearest_rank(values, 0.99)}


def decompose(timings: list[ClientTiming], rows: list[dict[str, Any]], server: dict[str, dict]) -> dict[str, Any]:
    """The client's TTFT split where it was spent, per request joined on its id (wall clock, one host).

    to_server: client send to the ASGI app called (the API server's event loop reading and parsing it);
    before_engine: to vLLM's arrival stamp; to_first_bytes: to the first token's bytes handed to the server
    (the row's `ttft_s`; vLLM's own first-token stamp is earlier: its histograms' view); after_stamp: to the
    bench middleware's own note of those bytes (about 0: a check that the stamp is where the bytes go out);
    to_client: to the client reading them (the client's own lag).
    """
    by_id = {r["request_id"]: r for r in rows}
    parts: dict[str, list[float]] = defaultdict(list)
    for t in timings:
        row, srv = by_id.get(f"cmpl-{t.request_id}-0"), server.get(t.request_id)
        if not (t.ok and row and srv and srv.get("first") and row["ttft_s"] is not None):
            continue
        arrival = row["ts"] - row["e2e_s"]
        first_token = arrival + row["ttft_s"]
        for name, value in (
            ("to_server", srv["entry"] - t.sent),
            ("before_engine", arrival - srv["entry"]),
            ("to_first_bytes", row["ttft_s"]),
            ("after_stamp", srv["first"] - first_token),
            ("to_client", t.sent + (t.ttft_s or 0.0) - srv["first"]),
        ):
            parts[name].append(value)
    return {"joined": len(parts["to_first_bytes"]), **{k: _pair(v) for k, v in parts.items()}}


def _server_times(path: Path | None) -> dict[str, dict]:
    if path is None or not path.exists():
        return {}
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {d["id"]: d for d in lines if d.get("id")}


def measure(
    *,
    url: str,
    model: str,
    db: Engine,
    instance: str,
    trace: list[TraceRequest],
    settle_s: float = SPAN_WAIT_S,
    timing_file: Path | None = None,
) -> dict[str, Any]:
    """Replay `trace` against `url` and read the three vantage points of the same requests."""
    with httpx.Client(timeout=10.0) as http:
        before = http.get(f"{url}/metrics").text
        wall0 = time.time()
        timings = asyncio.run(replay(url, model, trace, tag=f"ul{int(wall0)}"))
        wall1 = time.time()
        load = os.getloadavg()
        deadline = time.monotonic() + settle_s
        window: dict[str, Any] = {"start": wall0 - 1.0, "end": wall1 + 1.0, "instances": [instance]}
        while True:  # every request's span stored, and vLLM's histograms counted them all
            rows = queries.slowest_requests(db, metric="e2e", limit=10 * len(trace) + 10, **window)
            after = http.get(f"{url}/metrics").text
            counted = sum(1 for t in timings if t.ok)
            if len(rows) >= counted or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    ok = [t for t in timings if t.ok]
    headline = queries.headline_latency(db, **window)
    finished = [r for r in rows if r["status"] == "finished"]
    frontend = [r["frontend_s"] for r in finished if r["frontend_s"] is not None]
    return {
        "requests": len(trace),
        "window": {"start": wall0, "end": wall1},
        "client_ok": len(ok),
        "stored": len(finished),
        "loadavg_1m": round(load[0], 2),
        "client": {"ttft": _pair([t.ttft_s for t in ok if t.ttft_s is not None]), "e2e": _pair([t.e2e_s for t in ok])},
        "frontend_histograms": histogram_view(before, after),
        "headline": {
            "ttft": {"p50": headline.ttft_p50_s, "p99": headline.ttft_p99_s},
            "e2e": {"p50": headline.e2e_p50_s, "p99": headline.e2e_p99_s},
            "source": headline.source,
        },
        "spans_engine_view": {
            "ttft": _pair([r["ttft_s"] for r in finished if r["ttft_s"] is not None]),
            "e2e": _pair([r["e2e_s"] for r in finished]),
            "queue": _pair([r["queue_s"] for r in finished]),
        },
        "before_engine": _pair(frontend),
        **({"decomposition": decompose(timings, finished, _server_times(timing_file))} if timing_file else {}),
    }


def table(result: dict[str, Any]) -> str:
    """The side-by-side table (milliseconds) docs/vllm.md shows."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:,.0f}"

    rows = [
        ("light client (same host)", result["client"]),
        ("vLLM frontend histograms (buckets)", result["frontend_histograms"]),
        ("rows without the stage before the engine", result["spans_engine_view"]),
        ("kvpilot headline (from HTTP arrival)", result["headline"]),
    ]
    lines = ["| vantage point | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 |", "|---|---:|---:|---:|---:|"]
    for name, view in rows:
        t, e = view["ttft"], view["e2e"]
        lines.append(f"| {name} | {ms(t['p50'])} | {ms(t['p99'])} | {ms(e['p50'])} | {ms(e['p99'])} |")
    fe = result["before_engine"]
    lines.append(f"\nbefore the engine (p50/p99): {ms(fe['p50'])} / {ms(fe['p99'])} ms")
    lines.append(
        f"{result['requests']} requests, {result['client_ok']} answered, {result['stored']} stored; "
        f"load average (1 min) {result['loadavg_1m']}; source: {result['headline']['source']}"
    )
    parts = result.get("decomposition")
    if parts:
        lines.append(f"\nthe client's TTFT, split ({parts['joined']} requests joined), p50 / p99 ms:")
        for name in ("to_server", "before_engine", "to_first_bytes", "after_stamp", "to_client"):
            if name in parts:
                lines.append(f"- {name}: {ms(parts[name]['p50'])} / {ms(parts[name]['p99'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.vllm_server import server_args, server_env
    from integrations.vllm import LaunchOptions, VllmLauncher, find_vllm_python
    from kvpilot.vllm.workbench import workbench
    from plumbing.process import free_port

    parser = argparse.ArgumentParser(prog="python -m benchmarks.user_latency", description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("kvpilot-data/user-latency"))
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--burst-size", type=int, default=64)
    parser.add_argument("--gap-s", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decompose", action="store_true", help="also time the API server's side of each request")
    args = parser.parse_args(argv)
    trace = shared_prefix_trace(bursts=args.bursts, burst_size=args.burst_size, gap_s=args.gap_s, seed=args.seed)
    with workbench(args.work) as wb:
        vllm_args = server_args(
            wb.checkpoint,
            port=free_port(),
            max_model_len=512,
            kv_cache_bytes=16 * 2**20,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
        )
        vllm_args = [a for a in vllm_args if a != "--no-enable-prefix-caching"]  # shared prefixes: the cache on
        env = server_env()
        timing_file = None
        if args.decompose:
            timing_file = args.work / "server-times.jsonl"
            timing_file.unlink(missing_ok=True)
            vllm_args += ["--middleware", "kvpilot_bench_timing.ResponseTimes"]
            here = str(Path(__file__).resolve().parent / "asgi")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
            env[BENCH_TIMING_ENV] = str(timing_file)
        options = LaunchOptions(
            vllm_args=vllm_args,
            python=find_vllm_python(),
            collector_url=wb.collector_url,
            admin_token=wb.admin_token,
            instance="user-latency",
            run_id="user-latency",
            spool_dir=None,
            log_file=args.work / "vllm.log",
            env=env,
        )
        launcher = VllmLauncher(options)
        try:
            launcher.start().wait_ready(420.0)
            result = measure(
                url=launcher.url,
                model="bench",
                db=wb.db,
                instance="user-latency",
                trace=trace,
                timing_file=timing_file,
            )
        finally:
            launcher.stop()
            launcher.close()
    print(table(result))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
