"""`kvpilot bench ingest`: end-to-end HTTP ingest throughput against the raw driver's ceiling.

What is measured, in one run:
- a real collector (uvicorn, `python -m collector serve`, its own process) on a fresh SQLite file
  (WAL, synchronous=FULL: what it acknowledges is durable) and, where a server answers, PostgreSQL;
- a separate client process POSTing pre-serialized batches of 1,000 mixed events (request, step,
  alloc, sample in equal parts) over keep-alive connections, `CLIENT_CONCURRENCY` in flight;
- the ceiling: the same rows through the raw driver's `executemany` (sqlite3 / psycopg), one
  transaction per 1,000 rows with the same durability settings, no HTTP, no validation; on PostgreSQL
  also through COPY FROM STDIN in binary and text format (the collector writes with binary COPY there);
- `telemetry_overhead`: the engine's token throughput with the HTTP sink pushing to a live collector
  versus telemetry off (NullSink), same workload, runs interleaved to cancel drift: 1 - on/off,
  best run of each mode (also the median of the pairs, and the CPU the sink's own thread used).

Throughputs are best-of-N: on a shared machine other processes only ever slow a run down. The
collector's CPU time per event is reported too, as it does not depend on other load.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

BATCH_EVENTS = 1000
CLIENT_CONCURRENCY = 4
INGEST_RUNS = 2  # best of: other load on the machine only ever slows a run
T0 = float(int(time.time()) - 3600)  # an hour ago: a collector takes pushes within its raw retention only
TOKEN = "bench-token"


def make_events(n: int, start: int = 0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j in range(start, start + n):
        base = {"instance": f"e{j % 4}", "run_id": "bench", "ts": T0 + j * 1e-3}
        k = j % 4
        if k == 0:
            out.append(
                {
                    **base,
                    "type": "request",
                    "request_id": f"req-{j}",
                    "status": "finished",
                    "prompt_tokens": 128 + j % 512,
                    "output_tokens": 64 + j % 128,
                    "queue_s": 0.001 * (j % 50),
                    "prefill_s": 0.02,
                    "ttft_s": 0.03 + 0.001 * (j % 100),
                    "decode_s": 0.8,
                    "e2e_s": 0.85,
                }
            )
        elif k == 1:
            out.append(
                {
                    **base,
                    "type": "step",
                    "step": j,
                    "duration_s": 0.012,
                    "forward_s": 0.01,
                    "num_seqs": 16,
                    "prefill_tokens": 256,
                    "decode_tokens": 16,
                    "kv_blocks_used": 300 + j % 100,
                    "kv_blocks_total": 1024,
                    "queue_depth": j % 7,
                    "busy_s": 0.011,
                }
            )
        elif k == 2:
            out.append(
                {
                    **base,
                    "type": "alloc",
                    "op": "alloc",
                    "request_id": f"req-{j - 2}",
                    "blocks": 2,
                    "block_size": 32,
                    "bytes": 131072,
                    "usage_after": 0.3,
                }
            )
        else:
            out.append(
                {
                    **base,
                    "type": "sample",
                    "utilization": 0.7,
                    "memory_used_bytes": 40 * 2**30,
                    "memory_total_bytes": 141 * 2**30,
                    "kv_usage": 0.31,
                    "fragmentation": 0.02,
                    "internal_waste": 0.04,
                    "queue_depth": j % 7,
                    "running": 16,
                }
            )
    return out


def write_bodies(directory: Path, n_batches: int) -> list[Path]:
    paths = []
    for b in range(n_batches):
        path = directory / f"batch-{b:05d}.json"
        path.write_bytes(json.dumps({"events": make_events(BATCH_EVENTS, b * BATCH_EVENTS)}).encode())
        paths.append(path)
    return paths


# --- client process ----------------------------------------------------------------------------------


def client_main(url: str, token: str, directory: str, concurrency: int) -> None:
    """Runs in its own process: POST every body once, report events/s measured here."""
    import httpx

    bodies = [p.read_bytes() for p in sorted(Path(directory).glob("batch-*.json"))]
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    lock = threading.Lock()
    queue = list(enumerate(bodies))
    failures: list[str] = []

    def worker() -> None:
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        with httpx.Client(timeout=60.0, transport=transport) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    i, body = queue.pop(0)
                resp = client.post(
                    f"{url}/v1/ingest", content=body, headers={**headers, "Idempotency-Key": f"bench-{i}"}
                )
                if resp.status_code != 202:
                    failures.append(f"{resp.status_code}: {resp.text[:200]}")

    with httpx.Client() as warm:  # connection setup and first-request costs out of the timing
        warm.get(f"{url}/health")
    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    print(json.dumps({"elapsed_s": elapsed, "events": len(bodies) * BATCH_EVENTS, "failures": failures[:5]}))


def _http_ingest(db_url: str, bodies_dir: Path, log_path: Path) -> float:
    from collector.server import start_subprocess
    from collector.settings import CollectorSettings

    settings = CollectorSettings(db_url=db_url, ingest_token=TOKEN, scrape_enabled=False, port=0, log_level="warning")
    proc = start_subprocess(settings, log_path=log_path)
    cpu_before = _cpu_seconds(proc.proc.pid)
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.ingest",
                "client",
                proc.url,
                TOKEN,
                str(bodies_dir),
                str(CLIENT_CONCURRENCY),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        cpu = _cpu_seconds(proc.proc.pid) - cpu_before
    finally:
        proc.stop()
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if report["failures"]:
        raise RuntimeError(f"ingest bench: collector refused batches: {report['failures']}")
    return report["events"] / report["elapsed_s"], cpu / report["events"] * 1e6


def _cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc): cost per event, independent of other load."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# --- raw driver ceiling ------------------------------------------------------------------------------


def _rows(events: list[dict[str, Any]]) -> dict[str, list[tuple]]:
    from collector.ingest import EVENT_COLUMNS
    from engine.events import parse_event

    rows: dict[str, list[tuple]] = {}
    for e in events:
        model = parse_event(e)
        rows.setdefault(model.type, []).append(tuple(getattr(model, c) for c in EVENT_COLUMNS[model.type]))
    return rows


def _ceiling(db_url: str, bodies: list[Path], *, migrate: bool = False, writer: str = "executemany") -> float:
    """The same rows through the raw driver, commit per batch, same durability, no HTTP; returns events/s.

    `writer`: "executemany" (sqlite3 / psycopg) or, on PostgreSQL, "copy-binary" / "copy-text" (COPY FROM
    STDIN, the statement collector.bulk builds)."""
    from collector.db import make_engine, upgrade

    if migrate:
        upgrade(db_url)
    batches = [_rows(json.loads(p.read_bytes())["events"]) for p in bodies]
    engine = make_engine(db_url)
    try:
        elapsed = raw_write(engine, batches, writer)
    finally:
        engine.dispose()
    return sum(len(r) for rows in batches for r in rows.values()) / elapsed


def raw_write(engine: Any, batches: list[dict[str, list[tuple]]], writer: str) -> float:
    """Seconds to write `batches` (event kind -> row tuples) with `writer`, one transaction per batch."""
    from collector.bulk import copy_statement, executemany_sql, pg_types
    from collector.ingest import EVENT_COLUMNS
    from collector.schema import EVENT_TABLES

    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        started = time.perf_counter()
        for rows in batches:
            for kind, kind_rows in rows.items():
                table, cols = EVENT_TABLES[kind], EVENT_COLUMNS[kind]
                if writer == "executemany":
                    cur.executemany(executemany_sql(engine.dialect.paramstyle, table.name, cols), kind_rows)
                    continue
                fmt = writer.removeprefix("copy-")
                with cur.copy(copy_statement(table.name, cols, fmt)) as copy:
                    if fmt == "binary":
                        copy.set_types(list(pg_types(table, cols)))
                    for row in kind_rows:
                        copy.write_row(row)
            raw.commit()
        return time.perf_counter() - started
    finally:
        raw.close()


# --- PostgreSQL --------------------------------------------------------------------------------------


def _pg_base_url() -> str | None:
    return os.environ.get("KVPILOT_BENCH_PG_URL") or os.environ.get("KVPILOT_TEST_PG_URL")


def _pg_schema(base: str) -> tuple[str, str] | None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    schema = f"kvp_bench_{uuid.uuid4().hex[:8]}"
    try:
        admin = create_engine(base, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        admin.dispose()
    except Exception:
        return None
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    return schema, url.render_as_string(hide_password=False)


def _pg_drop(base: str, schema: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    admin.dispose()


PG_WRITERS = ("executemany", "copy-binary", "copy-text")


def _postgres_figures_none() -> dict[str, Any]:
    keys = ["postgres_events_per_s", "postgres_ceiling_events_per_s", "postgres_ratio"]
    keys += [f"postgres_{w.replace('-', '_')}_ceiling_events_per_s" for w in PG_WRITERS[1:]]
    return dict.fromkeys(keys)


def _postgres_figures(base: str, bodies_dir: Path, bodies: list[Path], root: Path) -> dict[str, Any]:
    """HTTP ingest into PostgreSQL and the raw ceilings of each writer, each run in a fresh schema.

    `postgres_ceiling_events_per_s` is executemany's (the figure this bench has always reported); the
    COPY ceilings beside it are what the collector's own writer (binary COPY) can reach."""
    from collector.db import upgrade

    out = _postgres_figures_none()
    http: list[tuple[float, float]] = []
    ceilings: dict[str, list[float]] = {w: [] for w in PG_WRITERS}
    for _attempt in range(INGEST_RUNS):
        for target in ("http", *PG_WRITERS):
            made = _pg_schema(base)
            if made is None:
                return out
            schema, pg_url = made
            try:
                upgrade(pg_url)
                if target == "http":
                    http.append(_http_ingest(pg_url, bodies_dir, root / "collector-pg.log"))
                else:
                    ceilings[target].append(_ceiling(pg_url, bodies, writer=target))
            finally:
                _pg_drop(base, schema)
    out["postgres_events_per_s"] = max(r for r, _ in http)
    out["postgres_collector_cpu_us_per_event"] = min(c for _, c in http)
    out["postgres_ceiling_events_per_s"] = max(ceilings["executemany"])
    for writer in PG_WRITERS[1:]:
        out[f"postgres_{writer.replace('-', '_')}_ceiling_events_per_s"] = max(ceilings[writer])
    out["postgres_ratio"] = out["postgres_events_per_s"] / out["postgres_ceiling_events_per_s"]
    out["postgres_ratio_vs_copy"] = out["postgres_events_per_s"] / out["postgres_copy_binary_ceiling_events_per_s"]
    return out


# --- telemetry overhead ------------------------------------------------------------------------------


def _thread_cpu_s(native_id: int | None) -> float:
    """CPU seconds one thread of this process has run (Linux schedstat, nanoseconds); 0.0 if unknown."""
    if native_id is None:
        return 0.0
    try:
        return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _engine_throughput(sink_factory, n_requests: int, max_tokens: int) -> tuple[float, float]:
    """(tokens/s of one fixed workload, CPU seconds the sink's own thread used during it)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sequence import SamplingParams

    cfg = EngineConfig.from_dict({"device": "auto", "telemetry": {"instance": "bench", "sample_interval_s": 0.05}})
    sink = sink_factory()
    engine = LLMEngine(cfg, sink=sink)
    engine.warmup(2)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(48 + i % 32)] for i in range(n_requests)]
    thread = getattr(sink, "_thread", None)
    tid = getattr(thread, "native_id", None)
    gc.collect()  # the previous run's engine must not be collected inside this run's timing
    cpu0 = _thread_cpu_s(tid)
    started = time.perf_counter()
    engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    sink_cpu = _thread_cpu_s(tid) - cpu0
    sink.close()
    return n_requests * max_tokens / elapsed, sink_cpu


def _emit_cost_ns(n: int = 200_000) -> dict[str, float]:
    """What `emit()` itself costs the engine thread per event, HttpSink vs NullSink (best of 3).

    The sink's batching thread is parked (huge batch size and interval) so this is the enqueue
    alone; that thread's own CPU is `telemetry_sink_thread_cpu_fraction`.
    """
    from engine.events import StepEvent
    from engine.http_sink import HttpSink
    from engine.sinks import NullSink
    from plumbing.process import free_port

    event = StepEvent.model_construct(**make_events(2)[1])
    parked = {"batch_size": n + 1, "flush_interval_s": 3600.0, "queue_size": n + 1, "spool_max_bytes": 0}
    dead = f"http://127.0.0.1:{free_port()}"
    out = {}
    for name, factory in (("null", NullSink), ("http", lambda: HttpSink(dead, **parked))):
        best = float("inf")
        for _ in range(3):
            sink = factory()
            started = time.perf_counter()
            for _ in range(n):
                sink.emit(event)
            best = min(best, (time.perf_counter() - started) / n * 1e9)
            if isinstance(sink, HttpSink):
                sink.close(timeout_s=0.5)
            else:
                sink.close()
        out[name] = best
    return out


def _telemetry_overhead(collector_url: str, spool_dir: Path, quick: bool) -> dict[str, Any]:
    """Interleaved off/on pairs of the same workload, sized so one run takes about `run_s` seconds."""
    from engine.http_sink import HttpSink
    from engine.sinks import NullSink

    run_s, rounds, budget_s = (1.5, 4, 25.0) if quick else (4.0, 6, 120.0)
    max_tokens = 32
    sinks: list[HttpSink] = []

    def http() -> HttpSink:
        sink = HttpSink(collector_url, token=TOKEN, spool_dir=spool_dir / f"s{len(sinks)}", flush_interval_s=0.5)
        sinks.append(sink)
        return sink

    _engine_throughput(NullSink, 4, 4)  # load kernels and caches outside the timings
    calibration, _ = _engine_throughput(NullSink, 16, max_tokens)
    n_requests = max(8, int(calibration * run_s / max_tokens))
    started = time.monotonic()
    on: list[float] = []
    off: list[float] = []
    sink_cpu_fraction: list[float] = []
    while len(on) < rounds and (not on or time.monotonic() - started < budget_s):
        if len(on) % 2:  # ABBA order: neither mode always runs first
            b, sink_cpu = _engine_throughput(http, n_requests, max_tokens)
            a, _ = _engine_throughput(NullSink, n_requests, max_tokens)
        else:
            a, _ = _engine_throughput(NullSink, n_requests, max_tokens)
            b, sink_cpu = _engine_throughput(http, n_requests, max_tokens)
        off.append(a)
        on.append(b)
        sink_cpu_fraction.append(sink_cpu / (n_requests * max_tokens / b))
    emit_ns = _emit_cost_ns()
    return {
        "telemetry_emit_ns_per_event": emit_ns,
        # Best-of-N per mode: interference from other processes only ever slows a run down.
        "telemetry_overhead": 1.0 - max(on) / max(off),
        "telemetry_overhead_median": 1.0 - statistics.median(b / a for a, b in zip(off, on, strict=True)),
        "telemetry_sink_thread_cpu_fraction": statistics.median(sink_cpu_fraction),
        "engine_tokens_per_s_telemetry_off": max(off),
        "engine_tokens_per_s_http_sink": max(on),
        "telemetry_requests_per_run": n_requests,
        "telemetry_events_sent": sum(s.sent for s in sinks),
        "telemetry_events_dropped": sum(s.dropped for s in sinks),
        "telemetry_rounds": len(on),
    }


# --- entry point -------------------------------------------------------------------------------------


def run_ingest_bench(quick: bool = False) -> dict[str, Any]:
    from collector.db import upgrade

    n_batches = 40 if quick else 200
    result: dict[str, Any] = {
        "quick": quick,
        "batch_events": BATCH_EVENTS,
        "batches": n_batches,
        "client_concurrency": CLIENT_CONCURRENCY,
        "sqlite_synchronous": "FULL",
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-ingest-") as tmp:
        root = Path(tmp)
        bodies_dir = root / "bodies"
        bodies_dir.mkdir()
        bodies = write_bodies(bodies_dir, n_batches)

        runs = []
        for attempt in range(INGEST_RUNS):
            db = f"sqlite:///{root / f'http-{attempt}.db'}"
            upgrade(db)
            runs.append(_http_ingest(db, bodies_dir, root / "collector-sqlite.log"))
        result["sqlite_events_per_s"] = max(r for r, _ in runs)
        result["sqlite_collector_cpu_us_per_event"] = min(c for _, c in runs)
        result["sqlite_ceiling_events_per_s"] = max(
            _ceiling(f"sqlite:///{root / f'raw-{i}.db'}", bodies, migrate=True) for i in range(INGEST_RUNS)
        )
        result["sqlite_ratio"] = result["sqlite_events_per_s"] / result["sqlite_ceiling_events_per_s"]

        base = _pg_base_url()
        result.update(_postgres_figures(base, bodies_dir, bodies, root) if base else _postgres_figures_none())

        from collector.server import start_subprocess
        from collector.settings import CollectorSettings

        tele_db = f"sqlite:///{root / 'telemetry.db'}"
        upgrade(tele_db)
        proc = start_subprocess(
            CollectorSettings(db_url=tele_db, ingest_token=TOKEN, scrape_enabled=False, port=0, log_level="warning")
        )
        try:
            result.update(_telemetry_overhead(proc.url, root / "spool", quick))
        finally:
            proc.stop()
    result["targets"] = {"sqlite_events_per_s": 100_000, "telemetry_overhead": 0.02}
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        client_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        print(json.dumps(run_ingest_bench(quick="--quick" in sys.argv), indent=2))
