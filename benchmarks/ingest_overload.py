"""`kvpilot bench ingest --overload`: the collector under more senders than it can store for.

Per level (4, 64 and 256 concurrent senders), a fresh collector (`python -m collector serve`, its own
process, SQLite with synchronous=FULL) and asyncio/httpx senders in this process, each pushing gzip
batches of 5,000 events for a bounded time and behaving as the engine's sink does: the same
Idempotency-Key until acknowledged, honouring Retry-After on 429/503. Meanwhile /health is polled every
0.1 s and the collector's RSS sampled. When the time is up the senders are cancelled mid-request, as
clients that give up, and the collector must go idle at once (`drain_s`).

Figures per level: `accepted_events_per_s` (acknowledged events over the level's duration),
`rejected_share` (429/503 answers among all answers), `health_p99_s`, `peak_rss_mb`, `lost` (events
acknowledged but not stored: must be 0), `drain_s`. `padded_gzip`: 30 senders of a 61 KB gzip body that
inflates to 60 MiB (whitespace around one event), the case that once took the collector to 1.7 GB.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.ingest import _cpu_seconds, make_events
from plumbing.percentile import nearest_rank

LEVELS = (4, 64, 256)
BATCH_EVENTS = 5000
TOKEN = "bench-overload"
TARGETS = {"health_p99_s": 0.5, "peak_rss_mb": 512, "lost": 0}
EVENT_TABLES = ("requests", "steps", "alloc_events", "samples")


@dataclass
class LevelStats:
    acked: dict[str, int] = field(default_factory=dict)
    answers: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    health_s: list[float] = field(default_factory=list)
    health_failures: int = 0
    rss_mb: list[float] = field(default_factory=list)


def _bodies(n: int) -> list[bytes]:
    return [
        gzip.compress(json.dumps({"events": make_events(BATCH_EVENTS, i * BATCH_EVENTS)}).encode(), 1) for i in range(n)
    ]


def padded_body(inflated_mib: int = 60) -> bytes:
    """One valid event and `inflated_mib` MiB of JSON whitespace: about 61 KB on the wire."""
    event = json.dumps(make_events(1)[0]).encode()
    return gzip.compress(b'{"events": [' + event + b" " * (inflated_mib * 2**20) + b"]}", 9)


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def _sender(client: httpx.AsyncClient, i: int, bodies: list[bytes], stats: LevelStats, stop_at: float) -> None:
    loop = asyncio.get_running_loop()
    n = 0
    while loop.time() < stop_at:
        key = f"s{i}-b{n}"
        body = bodies[(i + n) % len(bodies)]
        while loop.time() < stop_at:
            try:
                resp = await client.post("/v1/ingest", content=body, headers={"Idempotency-Key": key})
            except httpx.HTTPError as exc:
                stats.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.5)
                continue
            stats.answers[resp.status_code] += 1
            if resp.status_code in (200, 202):
                stats.acked[key] = resp.json()["events"]
                break
            if resp.status_code in (429, 503):
                retry = float(resp.headers.get("retry-after", "1"))
                await asyncio.sleep(retry * random.uniform(0.5, 1.5))
                continue
            break  # a refusal that retrying cannot fix
        n += 1


def probe_health(probe: httpx.Client) -> tuple[float, bool]:
    """One GET /health: (seconds it took, whether it answered 200); a connection error is a failure."""
    started = time.perf_counter()
    try:
        ok = probe.get("/health").status_code == 200
    except httpx.HTTPError:
        ok = False
    return time.perf_counter() - started, ok


def _watch(url: str, pid: int, stats: LevelStats, stop: threading.Event) -> None:
    """In a thread of its own, so that the senders' event loop does not delay the probe's timing."""
    with httpx.Client(base_url=url, timeout=5.0) as probe:
        while not stop.is_set():
            stats.rss_mb.append(_rss_mb(pid))
            seconds, ok = probe_health(probe)
            stats.health_s.append(seconds)
            stats.health_failures += not ok
            stop.wait(0.1)


async def _server_view(url: str) -> dict[str, float]:
    """The collector's own counters: batches it stored, refusals by reason, pushes in flight."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        text = (await client.get("/metrics")).text
    view: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvpilot_collector_ingest_batches_total":
                view[f"batches_{sample.labels['result']}"] = sample.value
            elif sample.name == "kvpilot_collector_ingest_rejected_total":
                view[f"rejected_{sample.labels['reason']}"] = sample.value
            elif sample.name == "kvpilot_collector_inflight_requests":
                view["inflight_requests"] = sample.value
            elif sample.name == "kvpilot_collector_ingest_batch_seconds_sum":
                view["storage_seconds"] = sample.value
    return view


async def _drive(
    url: str, pid: int, senders: int, bodies: list[bytes], duration_s: float
) -> tuple[LevelStats, float, dict[str, float]]:
    stats = LevelStats()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", "Content-Encoding": "gzip"}
    limits = httpx.Limits(max_connections=senders, max_keepalive_connections=senders)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(url, pid, stats, stop), name="bench-health", daemon=True)
    watcher.start()
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30.0) as client:
        stop_at = asyncio.get_running_loop().time() + duration_s
        tasks = [asyncio.create_task(_sender(client, i, bodies, stats, stop_at)) for i in range(senders)]
        await asyncio.wait(tasks, timeout=duration_s)
        for task in tasks:  # clients that give up mid-request
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    cancelled_at = time.perf_counter()
    drain_s = float("nan")
    while time.perf_counter() - cancelled_at < 30:
        if (await _server_view(url)).get("inflight_requests") == 0:
            drain_s = time.perf_counter() - cancelled_at
            break
        await asyncio.sleep(0.05)
    stop.set()
    watcher.join(10)
    return stats, drain_s, await _server_view(url)


def _lost(db_url: str, acked: dict[str, int]) -> int:
    """Events acknowledged but not stored: per acknowledged key, what its batch row and rows hold."""
    from sqlalchemy import text

    from collector.db import make_engine

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            batch_ids = {key: i for key, i in conn.execute(text("SELECT idempotency_key, id FROM ingest_batches"))}
            rows: Counter[int] = Counter()
            for table in EVENT_TABLES:
                for batch_id, n in conn.execute(text(f"SELECT batch_id, count(*) FROM {table} GROUP BY batch_id")):
                    rows[batch_id] += n
    finally:
        engine.dispose()
    return sum(max(0, n - rows.get(batch_ids.get(key, -1), 0)) for key, n in acked.items())


def _collector(root: Path, name: str, **overrides: Any):
    """A fresh collector process on its own SQLite file; `overrides` are CollectorSettings fields."""
    from collector.db import upgrade
    from collector.server import start_subprocess
    from collector.settings import CollectorSettings

    db_url = f"sqlite:///{root / f'{name}.db'}"
    upgrade(db_url)
    fields = {"ingest_token": TOKEN, "scrape_enabled": False, "port": 0, "log_level": "warning", **overrides}
    settings = CollectorSettings(db_url=db_url, **fields)
    return db_url, start_subprocess(settings, log_path=root / f"{name}.log")


def _run_level(root: Path, senders: int, bodies: list[bytes], duration_s: float) -> dict[str, Any]:
    db_url, proc = _collector(root, f"level-{senders}")
    cpu0, client0 = _cpu_seconds(proc.proc.pid), time.process_time()
    try:
        stats, drain_s, server = asyncio.run(_drive(proc.url, proc.proc.pid, senders, bodies, duration_s))
        server["collector_cpu_s"] = _cpu_seconds(proc.proc.pid) - cpu0
        server["client_cpu_s"] = time.process_time() - client0
    finally:
        proc.stop()
    answered = sum(stats.answers.values())
    return {
        "senders": senders,
        "duration_s": duration_s,
        "accepted_events_per_s": sum(stats.acked.values()) / duration_s,
        "rejected_share": (stats.answers[429] + stats.answers[503]) / answered if answered else 0.0,
        "health_p99_s": nearest_rank(stats.health_s, 0.99),
        "health_failures": stats.health_failures,
        "peak_rss_mb": max(stats.rss_mb, default=0.0),
        "lost": _lost(db_url, stats.acked),
        "drain_s": drain_s,
        "answers": {str(k): v for k, v in sorted(stats.answers.items())},
        "client_errors": dict(stats.errors),
        "server": server,
    }


def _run_padded(root: Path, senders: int, duration_s: float) -> dict[str, Any]:
    body = padded_body()
    db_url, proc = _collector(root, "padded")
    try:
        stats, drain_s, server = asyncio.run(_drive(proc.url, proc.proc.pid, senders, [body], duration_s))
    finally:
        proc.stop()
    return {
        "senders": senders,
        "wire_bytes": len(body),
        "inflated_mib": 60,
        "health_p99_s": nearest_rank(stats.health_s, 0.99),
        "peak_rss_mb": max(stats.rss_mb, default=0.0),
        "lost": _lost(db_url, stats.acked),
        "drain_s": drain_s,
        "answers": {str(k): v for k, v in sorted(stats.answers.items())},
        "client_errors": dict(stats.errors),
        "server": server,
    }


def run_overload_bench(quick: bool = False) -> dict[str, Any]:
    duration_s = 4.0 if quick else 10.0
    result: dict[str, Any] = {
        "quick": quick,
        "batch_events": BATCH_EVENTS,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-overload-") as tmp:
        root = Path(tmp)
        bodies = _bodies(8)
        result["wire_bytes_per_batch"] = len(bodies[0])
        result["levels"] = [_run_level(root, senders, bodies, duration_s) for senders in LEVELS]
        result["padded_gzip"] = _run_padded(root, 30, duration_s / 2)
    result["targets"] = TARGETS
    result["met"] = all(
        level["health_p99_s"] < TARGETS["health_p99_s"]
        and level["peak_rss_mb"] < TARGETS["peak_rss_mb"]
        and level["lost"] == 0
        for level in [*result["levels"], result["padded_gzip"]]
    )
    return result
