"""`kvpilot bench latency-sketch`: a fleet's latency reads over a long window, every request sorted against the
per-minute latency sketch, on the same rows of one PostgreSQL database.

The fleet bench reads under its live ingest, but its hour holds a minute or two of the fleet's traffic and a
thinned history: its reads do not show what an hour of 1,000 engines costs. Here a fresh database gets
`minutes` of a fleet's finished requests at its rate (2,000/s: 1,000 engines at 2 requests/s, lognormal
stages), COPYed in; the maintenance's roll builds the sketch (timed per minute of traffic); then the Latency
page's reads (`collector.queries`: the headline, the eight stages' percentiles, TTFT quantiles per minute)
over the window are timed with the sketch's watermark removed (every request read and sorted, as before the
sketch) and restored (the sketch, and the raw rows after it), in A B B A rounds so a drift of the machine
cancels. Every sketched quantile is checked against the exact one of the same rows: `max_rel_error` (at most
GAMMA - 1 = 2%, never below).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.fleet import FleetBenchError, _drop_database, _fresh_database

RATE = 2000.0  # finished requests/s: 1,000 engines at 2 requests/s (the fleet bench's rate)
INSTANCES = 1000
QUANTILES = (0.5, 0.9, 0.95, 0.99)


def _say(message: str) -> None:
    print(f"[bench latency-sketch {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _rows(start: float, seconds: int, rate: float, rnd: random.Random) -> list[tuple[Any, ...]]:
    """One stretch of the fleet's finished requests, as `requests` rows (`COLUMNS`)."""
    rows = []
    n = int(seconds * rate)
    for k in range(n):
        queue = rnd.lognormvariate(-4.0, 1.2)
        prefill = rnd.lognormvariate(-3.0, 0.7)
        out = max(1, int(rnd.lognormvariate(4.5, 0.8)))
        decode = out * rnd.lognormvariate(-3.6, 0.3)
        frontend = rnd.lognormvariate(-6.0, 0.5)
        rows.append(
            (
                f"e{k % INSTANCES:04d}",
                "fleet",
                start + k / rate,
                f"q{start:.0f}-{k}",
                "finished",
                0,
                int(rnd.lognormvariate(6.0, 0.8)),
                out,
                frontend,
                queue,
                prefill,
                queue + prefill,
                decode,
                queue + prefill + decode,
                0,
                0,
                0.0,
                0,
                "stop",
                False,
            )
        )
    return rows


COLUMNS = (
    "instance", "run_id", "ts", "request_id", "status", "priority", "prompt_tokens", "output_tokens", "frontend_s",
    "queue_s", "prefill_s", "ttft_s", "decode_s", "e2e_s", "preemptions", "swaps", "swap_s", "cached_tokens",
    "finish_reason", "warmup",
)  # fmt: skip


def run_latency_sketch_bench(
    pg_url: str, *, minutes: int = 30, rounds: int = 3, progress: Callable[[str], None] = _say
) -> dict[str, Any]:
    import os

    from sqlalchemy import delete, insert

    from collector import latency_rollup, partitions
    from collector.bulk import insert_rows
    from collector.db import make_engine, upgrade
    from collector.queries import latency_sketch as sketch
    from collector.schema import RequestRow, RollupWatermark, Run

    if not 1 <= minutes <= 120 or not 1 <= rounds <= 20:
        raise FleetBenchError(f"minutes must be within 1..120 and rounds within 1..20, got {minutes}, {rounds}")
    load_start = os.getloadavg()
    url = _fresh_database(pg_url)
    engine = make_engine(url)
    try:
        upgrade(url)
        end = math.floor(time.time() / 60.0) * 60.0 - 60.0
        start = end - minutes * 60.0
        with engine.connect() as conn:  # the day partitions and their BRIN summaries, as maintenance keeps them
            partitions.ensure_ahead(conn, now=end, behind_days=1, ahead_days=1)
        rnd = random.Random(0)
        t0 = time.perf_counter()
        table = RequestRow.__table__
        for m in range(minutes):
            with engine.begin() as conn:
                insert_rows(conn, table, COLUMNS, _rows(start + 60.0 * m, 60, RATE, rnd))
            progress(f"loaded minute {m + 1}/{minutes} ({int(RATE * 60 * (m + 1)):,} requests)")
        with engine.begin() as conn:
            conn.execute(insert(Run.__table__).values(instance="e0000", run_id="fleet", first_seen_ts=start,
                                                      last_seen_ts=end))  # fmt: skip
        load_s = time.perf_counter() - t0
        with engine.connect() as conn:
            partitions.summarize_brin(conn, now=end)
        with engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE requests")
        t0 = time.perf_counter()
        chunks = 0
        while True:
            with engine.begin() as conn:
                done = latency_rollup.roll_up(conn, now=end + latency_rollup.SETTLE_S + 1, first_start=start)
            if done is None:
                break
            chunks += 1
        roll_s = time.perf_counter() - t0
        with engine.connect() as conn:
            through = latency_rollup.watermark(conn, sketch.WATERMARK)
        progress(f"rolled {minutes} minutes in {roll_s:.1f} s ({chunks} transactions); watermark {through}")
        window = {"start": end - 3600.0, "end": end + 1.0}
        reads = _reads(engine, window)
        timings: dict[str, dict[str, list[float]]] = {name: {"raw": [], "sketch": []} for name in reads}
        answers: dict[str, dict[str, Any]] = {"raw": {}, "sketch": {}}
        w = RollupWatermark.__table__
        for r in range(rounds):
            for side in ("raw", "sketch", "sketch", "raw"):
                with engine.begin() as conn:
                    conn.execute(delete(w).where(w.c.name == sketch.WATERMARK))
                    if side == "sketch":
                        conn.execute(insert(w).values(name=sketch.WATERMARK, through_ts=through))
                for name, read in reads.items():
                    t = time.perf_counter()
                    answers[side][name] = read()
                    timings[name][side].append(time.perf_counter() - t)
            progress(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {statistics.median(t['raw']):.2f} s raw / {statistics.median(t['sketch']):.3f} s sketch"
                for n, t in timings.items()
            ))  # fmt: skip
        figures = {
            name: {
                "raw_median_s": round(statistics.median(t["raw"]), 4),
                "sketch_median_s": round(statistics.median(t["sketch"]), 4),
                "raw_max_s": round(max(t["raw"]), 4),
                "sketch_max_s": round(max(t["sketch"]), 4),
                "ratio": round(statistics.median(t["sketch"]) / statistics.median(t["raw"]), 4),
            }
            for name, t in timings.items()
        }
        errors = _errors(answers["raw"], answers["sketch"])
        with engine.connect() as conn:
            sketch_rows = conn.exec_driver_sql("SELECT count(*) FROM latency_sketches").scalar_one()
        return {
            "requests": int(RATE * 60 * minutes),
            "minutes": minutes,
            "rate_per_s": RATE,
            "instances": INSTANCES,
            "load_s": round(load_s, 1),
            "roll_s": round(roll_s, 2),
            "roll_s_per_minute": round(roll_s / minutes, 4),
            "sketch_rows": int(sketch_rows),
            "rounds": rounds,
            "reads": figures,
            "page_raw_median_s": round(sum(f["raw_median_s"] for f in figures.values()), 3),
            "page_sketch_median_s": round(sum(f["sketch_median_s"] for f in figures.values()), 3),
            "max_rel_error": errors["max"],
            "min_rel_error": errors["min"],
            "quantiles_checked": errors["n"],
            "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        }
    finally:
        engine.dispose()
        _drop_database(pg_url, url)


def _reads(engine: Any, window: dict[str, float]) -> dict[str, Callable[[], Any]]:
    """The Latency page's reads of the fleet over the window (`dashboard.data.latency`), by name."""
    from collector import queries
    from collector.queries.latency_sketch import METRICS

    def headline() -> Any:
        h = queries.headline_latency(engine, **window)
        return {"ttft": {0.5: h.ttft_p50_s, 0.99: h.ttft_p99_s}, "e2e": {0.5: h.e2e_p50_s, 0.99: h.e2e_p99_s}}

    def stages() -> Any:
        out = {}
        for metric in METRICS:
            [s] = queries.latency_percentiles(engine, metric=metric, quantiles=QUANTILES, group_by="all", **window)
            out[metric] = s.quantiles
        return out

    def ttft_per_minute() -> Any:
        buckets = queries.latency_quantiles_over_time(
            engine, bucket_s=60.0, metric="ttft", quantiles=(0.5, 0.9, 0.99), **window
        )
        return {f"ttft@{b.ts:.0f}": b.quantiles for b in buckets}

    return {"headline": headline, "stages": stages, "ttft_per_minute": ttft_per_minute}


def _errors(raw: dict[str, Any], sketched: dict[str, Any]) -> dict[str, Any]:
    """Relative error of every sketched quantile against the exact one (>= 0: the sketch never reads lower)."""
    rel: list[float] = []
    for name, groups in raw.items():
        for group, quantiles in groups.items():
            for q, exact in quantiles.items():
                got = sketched[name][group][q]
                if exact:
                    rel.append(got / exact - 1.0)
    return {"max": round(max(rel), 5), "min": round(min(rel), 5), "n": len(rel)}
