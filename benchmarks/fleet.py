"""`kvpilot bench fleet`: a fleet of 1,000 engines against collectors sharing one PostgreSQL.

What runs, in one database created fresh for the run (dropped after it):
- a history of every instance loaded first through the fast path (`collector.ingest.store_batch`, COPY);
- `copy_ceiling_events_per_s`: batches of 1,000 fleet events written by binary COPY alone into the same
  tables, one transaction each, no HTTP and no validation (`benchmarks.ingest.raw_write`), once before the
  live run and once after the saturation run, on the same database (the mean of the two; each in
  `copy_ceilings_events_per_s`: 40 batches, a fraction of a second, had moved 82-119k between runs);
- N collectors (`python -m collector serve`, each its own process on a free loopback port; 2 by default,
  `--collectors` 1 to 8 to see what one more buys), only the first scraping (one scraper per deployment);
- sender processes (`benchmarks.fleet_load`), at least one per collector, each playing a slice of the
  1,000 simulated engines as the HTTP sink ships them, `engines_per_relay` to a node, each node on its
  own one-second timer from its own phase with one push in flight: a node's pushes go as one bundle (POST
  /v1/ingest/bundle, each push under its own key), as the node's relay (`collector.relay`) forwards them;
  the engine-to-relay hop runs on each node's own cores in a fleet and is not played here (1: every
  engine pushes alone); a share of them send requests as OTLP spans,
  each engine its own export every 5 s as a vLLM's OpenTelemetry span processor does (`spans_dropped`: what
  a full span queue dropped);
- a DCGM-like exporter for 100 nodes x 8 GPUs: one local HTTP server, a page per node, each page a scrape
  target of the first collector;
- two alert evaluators on the one lease (`alerts.runner.start_evaluator`), a rule on queue depth evaluated
  every `rule_interval_s` (250 ms) and a local webhook receiver: a few engines turn hot during the run, each
  pushing on its own through a node relay (`kvpilot collector relay`, a process of its own) as an engine's
  sink does, its sample pushed when taken; `alert_delivery_p99_s` runs from the first hot sample's timestamp
  (the condition true) to the receiver's receipt, split at the acknowledgement of the push that carried it
  (`alert_stored_p99_s`: the push, the relay's hold and the ingest; `alert_evaluated_and_delivered_p99_s`: the
  rule's next evaluation and the delivery); what evaluating the rule costs is `alert_evaluation_*`;
- while the fleet pushes, the reads of the dashboard's Overview, Latency and KV pages (their
  `collector.queries` calls) and of `kvpilot status --instance`, round after round: `query_p95_s` per page.

After the live run the same senders play the fleet at `saturation_load` times its rates for `saturation_s`,
shipping as fast as they are answered: more than the collectors take, so what they acknowledge per second
(`saturated_events_per_s`) is their capacity on this machine, and `ratio` is that over the COPY ceiling. The
fleet at its own rate offers about half of a ceiling (`fleet_share_of_ceiling`): a ratio of what it sent would
measure the fleet's size, not the collectors.

`ingest_lag_p99_s` is per pushed batch: from its oldest event's timestamp to the collector's answer, which
comes after COMMIT; `ingest_age_at_send_*` and `ingest_answer_*` split it where the push left. Before each timed run
every engine sends its first push and the senders wait for them all (`first_contact_s`): a push that claims a new
instance or run is stored alone, so a fleet's first second is a thousand transactions, a cost of its own and not
the lag of a fleet that is running. The live senders outrank the collectors in the CPU scheduler where granted
(`plumbing.sched`), so that a batch leaves when its interval ends, as it would from the engine's own node.
`lost` is what collectors acknowledged minus what the database holds. A fleet at ~50
steps/s per engine offers far more than a 2-core machine can carry; the senders send what the machine
lets them (an instance's batch then spans a longer interval, thinned to 1,000 events as the sink's bounded
queue would), and `events_per_s` is what was acknowledged, beside `offered_events_per_s`.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx

from benchmarks import fleet_load
from plumbing.percentile import nearest_rank
from plumbing.process import stop_process

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TOKEN = "fleet-ingest-token"
ADMIN = "fleet-admin-token"
RULES = """
groups:
  - name: fleet
    interval: {interval}
    rules:
      - alert: FleetQueueHigh
        expr: queue_depth > 100
        for: 0s
        labels: {severity: page}
"""


OVERLOADED = 0.9  # of the collectors' capacity offered by the live fleet: its lag then measures the machine
MAX_COLLECTORS = 8  # collector processes on one machine; more measure the machine, not kvpilot


@dataclass(frozen=True)
class FleetConfig:
    instances: int = 1000
    collectors: int = 2
    senders: int = 2  # processes; each pushes to one collector
    # pushes in flight per sender process in the saturation run and the first contact; in the live run each node
    # ships on its own timer, one push in flight, as a fleet's relays do
    sender_threads: int = 16
    live_s: float = 150.0
    history_events_per_instance: int = 3000  # over 24 h (`fleet_load.HISTORY_S`), thinned
    ceiling_batches: int = 300  # of 1,000 events, written twice: before the live run and after the saturation
    dcgm_nodes: int = 100
    scrape_interval_s: float = 15.0  # the collector's default, and Prometheus's
    otlp_share: float = 0.1
    alert_trials: int = 10  # hot engines, each one alert: the p99 of a handful is their slowest
    # the paging rule's evaluation interval: a page within a second of the condition needs the rule evaluated
    # within a fraction of one (each evaluation's cost is in the JSON: `alert_evaluation_*`)
    rule_interval_s: float = 0.25
    engines_per_relay: int = 8  # a node's GPUs: its engines' pushes go as one bundle (1: each pushes alone)
    # an engine's push interval (`telemetry.http_flush_interval_s`, 1 s by default): the floor of the ingest lag
    engine_flush_s: float = 1.0
    # after the live run, the same fleet at `saturation_load` times its rates for `saturation_s`: more than the
    # collectors take, so what they acknowledge is their capacity (`ratio`'s numerator)
    saturation_s: float = 30.0
    saturation_load: float = 4.0
    # from the senders' launch to a timed run: time for every engine's first push (`fleet_load`'s `first_contact`:
    # a push that claims a new instance or run is stored alone), so that the run measures a fleet already known
    first_contact_lead_s: float = 15.0

    @classmethod
    def for_run(cls, quick: bool, collectors: int = 2) -> FleetConfig:
        """The bench's sizes; `collectors` other than 2 measures what one more (or one fewer) buys. Every
        collector gets at least one sender process of its own."""
        senders = max(cls.senders, collectors)
        if quick:
            return cls(
                collectors=collectors,
                senders=senders,
                live_s=60.0,
                history_events_per_instance=300,
                ceiling_batches=150,
                alert_trials=5,
                saturation_s=20.0,
            )
        return cls(collectors=collectors, senders=senders)


class FleetBenchError(RuntimeError):
    """The bench cannot run (no PostgreSQL, a collector that would not start)."""


def pg_url_from_env() -> str:
    return os.environ.get("KVPILOT_BENCH_PG_URL") or os.environ.get("KVPILOT_TEST_PG_URL") or DEFAULT_PG_URL


def _say(message: str) -> None:
    print(f"[bench fleet {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- database ---------------------------------------------------------------------------------------


def _fresh_database(base: str) -> str:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"kvp_fleet_{uuid.uuid4().hex[:10]}"
    try:
        admin = create_engine(base, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
    except Exception as exc:
        shown = make_url(base).render_as_string(hide_password=True)
        raise FleetBenchError(f"PostgreSQL at {shown} cannot create a database: {type(exc).__name__}: {exc}") from None
    return make_url(base).set(database=name).render_as_string(hide_password=False)


def _drop_database(base: str, url: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    admin.dispose()


def _scalar(engine: Any, sql: str) -> Any:
    from sqlalchemy import text

    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar_one()


def _load_history(engine: Any, config: FleetConfig, batch_events: int = 5000) -> dict[str, Any]:
    """The day's history through `store_batch` (COPY) in time order, `batch_events` to a batch, into the day
    partitions a running collector would have made (`collector.partitions.ensure_ahead`)."""
    from collector import partitions
    from collector.ingest import parse_batch, store_batch
    from collector.maintenance import BEHIND_DAYS

    now = time.time()
    with engine.connect() as conn:
        partitions.ensure_ahead(conn, now=now, behind_days=BEHIND_DAYS, ahead_days=3)
    started = time.perf_counter()
    stored = 0
    batches = fleet_load.history_batches(config.instances, config.history_events_per_instance, now)
    for k, events in enumerate(batches):
        for g in range(0, len(events), batch_events):
            body = ('{"events":[' + ",".join(events[g : g + batch_events]) + "]}").encode()
            batch = parse_batch(body, max_events=100_000)
            stored += store_batch(engine, batch, idempotency_key=f"history-{k}-{g}", content=body).events
    elapsed = time.perf_counter() - started
    return {"history_events": stored, "history_load_events_per_s": round(stored / elapsed)}


def _copy_ceiling(engine: Any, batches: int) -> float:
    from benchmarks.ingest import raw_write
    from collector.ingest import parse_batch

    rng = random.Random(11)
    rows = []
    now = time.time()
    for b in range(batches):
        name = f"ceiling-{b % 50}"
        sim = fleet_load.Engine(name, fleet_load.run_of("fleet-ceiling", name), rng)
        batch, _ = sim.events(now - 60, now, fleet_load.Rates(), cap=1000)
        rows.append(parse_batch(batch.body(), max_events=100_000).rows)
    elapsed = raw_write(engine, rows, "copy-binary")
    return sum(len(r) for batch in rows for r in batch.values()) / elapsed


# --- peers ------------------------------------------------------------------------------------------


def _start_collectors(url: str, config: FleetConfig, logs: Path) -> list[Any]:
    from collector.errors import CollectorError
    from collector.server import start_subprocess
    from collector.settings import CollectorSettings

    procs = []
    for k in range(config.collectors):
        settings = CollectorSettings(
            db_url=url,
            port=0,
            ingest_token=TOKEN,
            admin_token=ADMIN,
            scrape_enabled=k == 0,
            scrape_allow_nets=("127.0.0.0/8",),
            max_instances_per_identity=config.instances * 4,
            max_new_instances_per_minute=config.instances * 4,
            max_new_runs_per_minute_per_identity=config.instances * 4,
            log_level="warning",
        )
        try:
            procs.append(start_subprocess(settings, log_path=logs / f"collector-{k}.log", timeout_s=60.0))
        except CollectorError as exc:
            for proc in procs:
                proc.stop()
            raise FleetBenchError(f"collector {k}: {exc} (log: {logs / f'collector-{k}.log'})") from None
    return procs


@dataclass
class _Relay:
    proc: subprocess.Popen
    url: str


def _start_relay(upstream: str, logs: Path) -> _Relay:
    """One node relay (`kvpilot collector relay`, its default 0.2-s hold) in front of the first collector: the hot
    engines push through it, so an alert's delay holds the hop every engine of a fleet takes to its collector."""
    from plumbing.process import ProcessStartError, free_port, spawn, wait_healthy

    port = free_port()
    log = logs / "relay.log"
    proc = spawn(
        [sys.executable, "-m", "kvpilot.cli", "collector", "relay", "--upstream", upstream, "--port", str(port)],
        log_path=log,
        env={**os.environ, "KVPILOT_INGEST_TOKEN": TOKEN},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/health", proc, timeout_s=60.0, what="the relay", log_path=log)
    except ProcessStartError as exc:
        stop_process(proc)
        raise FleetBenchError(str(exc)) from None
    return _Relay(proc, url)


def _relay_pushes(url: str) -> dict[str, int]:
    """The pushes the relay answered, by the status they got (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return {
        sample.labels["status"]: int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "kvpilot_relay_members"
        for sample in family.samples
        if sample.name == "kvpilot_relay_members_total"
    }


class _DcgmHandler(BaseHTTPRequestHandler):
    pages: ClassVar[dict[int, bytes]] = {}

    def do_GET(self) -> None:
        match = re.fullmatch(r"/node/(\d+)/metrics", self.path)
        page = self.pages.get(int(match.group(1))) if match else None
        self.send_response(200 if page else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(page or b"")))
        self.end_headers()
        self.wfile.write(page or b"")

    def log_message(self, *args: Any) -> None:
        pass


def _start_dcgm(nodes: int) -> ThreadingHTTPServer:
    rng = random.Random(3)
    handler = type("DcgmHandler", (_DcgmHandler,), {"pages": {n: fleet_load.dcgm_page(n, rng) for n in range(nodes)}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _register_targets(collector_url: str, dcgm_port: int, config: FleetConfig) -> None:
    with httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30.0) as client:
        for n in range(config.dcgm_nodes):
            target = {
                "url": f"http://127.0.0.1:{dcgm_port}/node/{n}/metrics",
                "job": "dcgm",
                "instance": f"node-{n:03d}",
                "interval_s": config.scrape_interval_s,
                "labels": {"node": f"node-{n:03d}"},
            }
            resp = client.post(f"{collector_url}/v1/targets", json=target)
            if resp.status_code != 201:
                raise FleetBenchError(f"registering scrape target {n}: {resp.status_code} {resp.text[:200]}")


# --- reads under load --------------------------------------------------------------------------------


def page_reads(url: str, engine: Any, instances: int) -> dict[str, Callable[[float, float], Any]]:
    """Per page, what it reads from collector.queries for one window (all instances); `kvpilot status` for
    one instance of the fleet (over all of them its diagnosis runs queries per instance: minutes at 1,000)."""
    from collector import queries
    from kvpilot.cli_status import collect

    def overview(start: float, end: float) -> None:
        queries.headline_latency(engine, start=start, end=end)
        facts = queries.step_facts(engine, start=start, end=end)  # as the dashboard does: read once for both
        queries.engine_peaks(engine, start=start, end=end, facts=facts)
        queries.step_load_lines(engine, start=start, end=end, bucket_s=60.0, facts=facts)

    def latency(start: float, end: float) -> None:
        for metric in ("ttft", "e2e"):
            queries.latency_percentiles(engine, start=start, end=end, metric=metric, group_by="all")
            queries.latency_quantiles_over_time(engine, start=start, end=end, bucket_s=60.0, metric=metric)
        queries.stage_breakdown_over_time(engine, start=start, end=end, bucket_s=300.0)

    def kv(start: float, end: float) -> None:
        queries.kv_over_time(engine, start=start, end=end, bucket_s=60.0)
        queries.alloc_ops_over_time(engine, start=start, end=end, bucket_s=300.0)
        queries.alloc_trace(engine, start=start, end=end, limit=2000)

    def status(start: float, end: float) -> None:
        collect(url, instance=fleet_load.instance_name(int(end) % instances), since="1h", run_id=None, now=end)

    return {"overview": overview, "latency": latency, "kv": kv, "status --instance": status}


def _read_loop(url: str, instances: int, stop: threading.Event, timings: dict[str, list[float]]) -> None:
    """Every page's reads in turn, whole rounds, until `stop` (the first round always completes)."""
    from collector.db import make_engine

    engine = make_engine(url, pool_size=2)
    reads = page_reads(url, engine, instances)
    try:
        while True:
            for page, read in reads.items():
                end = time.time()
                started = time.perf_counter()
                read(end - 3600.0, end)
                timings[page].append(time.perf_counter() - started)
            if stop.wait(1.0):
                break
    finally:
        engine.dispose()


# --- senders ---------------------------------------------------------------------------------------


def _saturation_configs(live: list[dict], config: FleetConfig, start: float) -> list[dict]:
    """The live senders' slices again, every rate `saturation_load` times as high, shipping as fast as they are
    answered, under their own run id; no engine turns hot."""
    rates = {k: v * config.saturation_load for k, v in asdict(fleet_load.Rates()).items()}
    return [
        {
            **c,
            "rates": rates,
            "hot": {},
            "min_interval_s": 0.0,
            "outrank": False,  # a throughput figure: senders above the collectors would take the cores they measure
            "run_id": fleet_load.SATURATION_RUN,
            "start": start,
            "until": start + config.saturation_s,
        }
        for c in live
    ]


def _sender_configs(
    config: FleetConfig, collector_urls: list[str], start: float, *, hot_url: str
) -> tuple[list[dict], dict]:
    names = [fleet_load.instance_name(i) for i in range(config.instances)]
    slices = [names[k :: config.senders] for k in range(config.senders)]
    every = max(1, round(1 / config.otlp_share)) if config.otlp_share > 0 else 0
    otlp = {name for mine in slices for name in mine[::every]} if every else set()  # the same share per collector
    step = max(1, config.instances // max(1, config.alert_trials))
    hot_names = [names[1 + j * step] for j in range(config.alert_trials) if 1 + j * step < len(names)]
    hot = {name: start + config.live_s * (0.2 + 0.3 * j / max(1, len(hot_names))) for j, name in enumerate(hot_names)}
    out = []
    for k in range(config.senders):
        mine = slices[k]
        out.append(
            {
                "url": collector_urls[k % len(collector_urls)],
                "token": TOKEN,
                "instances": mine,
                "otlp_instances": sorted(otlp & set(mine)),
                "hot": {n: t for n, t in hot.items() if n in mine},
                "hot_url": hot_url,  # the hot engines push to a node relay, as an engine's sink does in a fleet
                "rates": asdict(fleet_load.Rates()),
                "batch_events": 1000,
                "engines_per_node": config.engines_per_relay,
                "min_interval_s": config.engine_flush_s,
                "threads": config.sender_threads,
                # a fleet's engines push on their own nodes' cores, on time: played on the collectors' machine,
                # the senders take the CPU first (`plumbing.sched.outrank`) so that a batch leaves when its
                # interval ends, and its lag is the collectors', not the senders' backlog
                "outrank": True,
                "first_contact": True,
                "start": start,
                "until": start + config.live_s,
            }
        )
    return out, {"otlp_instances": len(otlp), "hot": hot}


def _run_senders(configs: list[dict], timeout_s: float) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fleet_load", "sender", json.dumps(c)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for c in configs
    ]
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            raise FleetBenchError(f"a sender exited with {proc.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


# --- entry point -------------------------------------------------------------------------------------


def run_fleet_bench(pg_url: str, config: FleetConfig, progress: Callable[[str], None] = _say) -> dict[str, Any]:
    """Run the fleet against a fresh database on the PostgreSQL at `pg_url`; returns the figures."""
    from collector.db import make_engine, upgrade

    if not 1 <= config.collectors <= MAX_COLLECTORS or config.instances < config.senders:
        raise FleetBenchError(
            f"collectors must be 1 to {MAX_COLLECTORS}, with an instance per sender (got {config.collectors} "
            f"collectors, {config.senders} senders, {config.instances} instances)"
        )
    if config.senders < config.collectors:
        raise FleetBenchError(f"{config.senders} senders leave a collector of {config.collectors} without traffic")
    load_start = os.getloadavg()
    url = _fresh_database(pg_url)
    progress(f"database {url.rsplit('/', 1)[-1]} created; migrating")
    try:
        upgrade(url)
        engine = make_engine(url)
        try:
            empty_bytes = _scalar(engine, "SELECT pg_database_size(current_database())")
            result = _run(url, engine, config, progress)
            stored_rows = sum(
                _scalar(engine, f"SELECT count(*) FROM {t}")
                for t in ("requests", "steps", "alloc_events", "samples", "gaps", "series_points")
            )
            used = _scalar(engine, "SELECT pg_database_size(current_database())") - empty_bytes
            result["db_rows"] = stored_rows
            result["db_mb_per_million_events"] = round(used / 2**20 / stored_rows * 1e6, 1) if stored_rows else None
        finally:
            engine.dispose()
    finally:
        _drop_database(pg_url, url)
    load_end = os.getloadavg()
    result["load_average"] = {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in load_end]}
    result["cpu_count"] = os.cpu_count()
    result["config"] = asdict(config)
    return result


def _run(url: str, engine: Any, config: FleetConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    from alerts.config import webhook_config
    from alerts.durations import format_duration
    from alerts.runner import start_evaluator
    from alerts.sink import run_webhook_sink

    result: dict[str, Any] = {"instances": config.instances, "collectors": config.collectors}
    progress(
        f"loading a history of {config.instances} instances x {config.history_events_per_instance} events over "
        f"{fleet_load.HISTORY_S / 3600:.0f} h"
    )
    result.update(_load_history(engine, config))
    progress("COPY ceiling (no HTTP)")
    ceilings = [_copy_ceiling(engine, config.ceiling_batches)]
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-fleet-") as tmp:
        root = Path(tmp)
        progress(f"starting {config.collectors} collectors, {config.dcgm_nodes} DCGM targets, 2 alert evaluators")
        collectors = _start_collectors(url, config, root)
        relay = _start_relay(collectors[0].url, root)
        dcgm = _start_dcgm(config.dcgm_nodes)
        sink = run_webhook_sink(port=0, log_payloads=False)
        rules = root / "rules.yml"
        rules.write_text(RULES.replace("{interval}", format_duration(config.rule_interval_s)))
        notifier = webhook_config([sink.url], group_wait_s=0.0, group_interval_s=1.0, group_by=["instance"])
        evaluators = []
        stop_reads = threading.Event()
        timings: dict[str, list[float]] = {p: [] for p in ("overview", "latency", "kv", "status --instance")}
        reader = threading.Thread(target=_read_loop, args=(url, config.instances, stop_reads, timings), daemon=True)
        try:
            _register_targets(collectors[0].url, dcgm.server_address[1], config)
            registered = time.time()
            for _ in range(2):
                evaluators.append(
                    start_evaluator(url, rule_files=[rules], notifier=notifier, poll_s=0.25, lease_ttl_s=5.0)
                )
            start = time.time() + config.first_contact_lead_s
            configs, plan = _sender_configs(config, [c.url for c in collectors], start, hot_url=relay.url)
            progress(f"{config.senders} sender processes pushing for {config.live_s:.0f} s")
            reader.start()
            reports = _run_senders(configs, timeout_s=config.live_s + 120.0)
            elapsed = time.time() - start
            stop_reads.set()
            turned_hot = sum(len(r["first_hot"]) for r in reports)
            progress(f"waiting for the notifications of the {turned_hot} engines that turned hot")
            sink.wait_for(turned_hot, timeout_s=60.0)
            stop_reads.set()
            reader.join(300.0)
            quiet = _quiet_evaluations(engine, evaluators[0].evaluator.groups[0].rules[0].expr, config.rule_interval_s)
            quiet["alert_relay_pushes"] = _relay_pushes(relay.url)
            progress(f"saturation: the fleet at {config.saturation_load:g}x its rates for {config.saturation_s:.0f} s")
            saturation_start = time.time() + config.first_contact_lead_s
            saturated = _run_senders(
                _saturation_configs(configs, config, saturation_start), timeout_s=config.saturation_s + 120.0
            )
            saturation_elapsed = time.time() - saturation_start
        finally:
            stop_reads.set()
            if reader.ident is not None:  # started: a failure before it (a collector's start) has no reader
                reader.join(300.0)
            scraped_until = time.time()
            for evaluator in evaluators:
                evaluator.stop()
            stop_process(relay.proc)
            for proc in collectors:
                proc.stop()
            dcgm.shutdown()
            sink.stop()
    progress("COPY ceiling again (no HTTP), after the saturation")
    ceilings.append(_copy_ceiling(engine, config.ceiling_batches))
    result.update(_ingest_figures(engine, reports, elapsed, config))
    result.update(_saturation_figures(engine, saturated, saturation_elapsed))
    result["lost"] += result.pop("saturation_lost")
    # the ceiling measured on either side of the saturation run, on the same database: what raw COPY took
    # before the fleet's rows and after them, the collectors' capacity measured between the two
    result["copy_ceilings_events_per_s"] = [round(c) for c in ceilings]
    result["copy_ceiling_events_per_s"] = round(sum(ceilings) / len(ceilings))
    result["ratio"] = round(result["saturated_events_per_s"] / result["copy_ceiling_events_per_s"], 3)
    result["fleet_share_of_ceiling"] = round(result["events_per_s"] / result["copy_ceiling_events_per_s"], 3)
    # what the fleet offered at its own rates over what the collectors take: at 1 or more the machine cannot carry
    # the fleet, its queue only grows, and the lag measures that overload rather than the ingest
    result["offered_share_of_capacity"] = round(
        result["offered_events_per_s"] / max(result["saturated_events_per_s"], 1.0), 3
    )
    if result["offered_share_of_capacity"] >= OVERLOADED:
        progress(
            f"the fleet offered {result['offered_share_of_capacity']:.0%} of what the collectors take on this machine: "
            "its lag and delivery figures measure the overload"
        )
    result.update(_alert_figures(sink, reports, plan))
    result.update(_evaluation_figures([e.evaluator.metrics for e in evaluators], config))
    result.update(quiet)
    result["query_p95_s"] = {p: _round(nearest_rank(v, 0.95)) for p, v in timings.items()}
    result["query_rounds"] = {p: len(v) for p, v in timings.items()}
    result["otlp_instances"] = plan["otlp_instances"]
    result.update(_scrape_figures(engine, scraped_s=scraped_until - registered))
    return result


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ingest_figures(engine: Any, reports: list[dict], elapsed: float, config: FleetConfig) -> dict[str, Any]:
    acked: dict[str, int] = {}
    for report in reports:
        for kind, n in report["acked"].items():
            acked[kind] = acked.get(kind, 0) + n
    stored = _stored_events(engine, fleet_load.LIVE_RUN)
    lags = [lag for report in reports for lag in report["lags"]]
    ages = [age for report in reports for age in report["ages_at_send"]]
    answers = [answer for report in reports for answer in report["answers"]]
    total = sum(acked.values())
    first, first_s = _first_contact(reports)
    return {
        "events_per_s": round(total / elapsed),
        "offered_events_per_s": round(sum(r["offered"] for r in reports) / elapsed),
        "nominal_events_per_s": round(config.instances * fleet_load.Rates().total),
        "live_s": round(elapsed, 1),
        "acked_events": acked,
        "stored_events": stored,
        "lost": total + first - sum(stored.values()),
        "first_contact_s": first_s,
        "unacked_events": sum(r["unacked"] for r in reports),
        "spans_dropped": sum(r["spans_dropped"] for r in reports),
        "batches": len(lags),
        "ingest_lag_p50_s": _round(nearest_rank(lags, 0.5)),
        "ingest_lag_p99_s": _round(nearest_rank(lags, 0.99)),
        # where the lag goes: the oldest event's age when its push left (the engine's flush interval, and the
        # node's previous push where its answer came after the next was due), and the push to its answer
        "ingest_age_at_send_p50_s": _round(nearest_rank(ages, 0.5)),
        "ingest_age_at_send_p99_s": _round(nearest_rank(ages, 0.99)),
        "ingest_answer_p50_s": _round(nearest_rank(answers, 0.5)),
        "ingest_answer_p99_s": _round(nearest_rank(answers, 0.99)),
        # the answers' tail, where and when: per collector (each sender pushes to one), and per 10 s of the run
        "ingest_answer_p99_by_collector_s": _answer_tail_by_collector(reports, config.collectors),
        "ingest_answer_p99_by_10s": _answer_tail_by_window(
            reports, start=min((t for r in reports for t in r["sent_at"]), default=0.0), window_s=10.0
        ),
        "sender_failures": [f for r in reports for f in r["failures"]][:5],
        "sender_sched": sorted({r.get("sched", "nice 0") for r in reports}),  # how the live senders were scheduled
    }


def _answer_tail_by_collector(reports: list[dict], collectors: int) -> list[float | None]:
    """The answer p99 of each collector's pushes (sender k pushes to collector k mod N, `_sender_configs`)."""
    by: list[list[float]] = [[] for _ in range(collectors)]
    for k, report in enumerate(reports):
        by[k % collectors].extend(report["answers"])
    return [_round(nearest_rank(answers, 0.99)) for answers in by]


def _answer_tail_by_window(reports: list[dict], *, start: float, window_s: float) -> list[float | None]:
    """The answer p99 of the pushes sent in each `window_s` of the run, in order: a tail that comes back at a
    period (a scrape round, a checkpoint) shows as its windows."""
    by: dict[int, list[float]] = {}
    for report in reports:
        for sent, answer in zip(report["sent_at"], report["answers"], strict=True):
            by.setdefault(int((sent - start) // window_s), []).append(answer)
    return [_round(nearest_rank(by.get(k, []), 0.99), 2) for k in range(max(by, default=-1) + 1)]


def _saturation_figures(engine: Any, reports: list[dict], elapsed: float) -> dict[str, Any]:
    """What the collectors acknowledged per second while offered `saturation_load` times the fleet's rates."""
    first, first_s = _first_contact(reports)
    acked = sum(n for report in reports for n in report["acked"].values())
    stored = _stored_events(engine, fleet_load.SATURATION_RUN)
    return {
        "saturated_events_per_s": round(acked / elapsed),
        "saturation_offered_events_per_s": round(sum(r["offered"] for r in reports) / elapsed),
        "saturation_s": round(elapsed, 1),
        "saturation_batches": sum(len(report["lags"]) for report in reports),  # one lag per acknowledged push
        "saturation_lost": acked + first - sum(stored.values()),
        "saturation_first_contact_s": first_s,
        "saturation_failures": [f for r in reports for f in r["failures"]][:5],
    }


def _first_contact(reports: list[dict]) -> tuple[int, float | None]:
    """The events of every engine's first push, stored under the run before it was timed (they count in `lost`,
    not in its rate), and the longest a sender took to have them all stored."""
    acked = sum(r["first_contact_acked"] for r in reports)
    return acked, _round(max((r.get("first_contact_s", 0.0) for r in reports), default=None))


def _stored_events(engine: Any, run: str) -> dict[str, int]:
    """Rows of every event table in the bench's run `run` (every engine's own run id in it), by kind."""
    from sqlalchemy import func, select

    from collector.schema import EVENT_TABLES

    prefix = fleet_load.run_of(run, "")
    with engine.connect() as conn:
        return {
            kind: conn.execute(
                select(func.count()).select_from(table).where(table.c.run_id.startswith(prefix, autoescape=True))
            ).scalar_one()
            for kind, table in EVENT_TABLES.items()
        }


def _alert_figures(sink: Any, reports: list[dict], plan: dict) -> dict[str, Any]:
    first_hot = {name: ts for r in reports for name, ts in r["first_hot"].items()}
    received: dict[str, float] = {}
    for got in sink.received:
        for alert in got.payload.get("alerts", []):
            name = alert["labels"].get("instance")
            if alert.get("status") == "firing" and name in first_hot:
                received.setdefault(name, got.at)
    stored = {name: ts for r in reports for name, ts in r["hot_stored"].items()}
    delays = [received[n] - first_hot[n] for n in received]
    # where the time goes: the engine's next push and the ingest (to the acknowledgement, after COMMIT), then the
    # rule's next evaluation and the delivery
    to_stored = [stored[n] - first_hot[n] for n in received]
    after_stored = [received[n] - stored[n] for n in received]
    return {
        "alert_trials": len(first_hot),  # hot engines whose hot sample was sent (and acknowledged)
        "alert_trials_planned": len(plan["hot"]),
        "alerts_delivered": len(delays),
        "alert_delivery_p99_s": _round(nearest_rank(delays, 0.99)),
        "alert_stored_p99_s": _round(nearest_rank(to_stored, 0.99)),
        "alert_evaluated_and_delivered_p99_s": _round(nearest_rank(after_stored, 0.99)),
        "alert_duplicate_posts": sink.duplicates,
    }


def _evaluation_figures(metrics: list[Any], config: FleetConfig) -> dict[str, Any]:
    """What evaluating the paging rule cost, from the evaluators' own metrics (the lease's holder evaluates; a
    standby that took over adds its own): evaluations, their mean, the histogram bucket holding the 99th
    percentile, and evaluations skipped because one came back later than the next interval."""
    count = total = missed = 0.0
    buckets: dict[float, float] = {}
    for m in metrics:
        for family in m.registry.collect():
            for sample in family.samples:
                if family.name == "kvpilot_alerts_rule_group_duration_seconds":
                    if sample.name.endswith("_count"):
                        count += sample.value
                    elif sample.name.endswith("_sum"):
                        total += sample.value
                    elif sample.name.endswith("_bucket"):
                        bound = float(sample.labels["le"])
                        buckets[bound] = buckets.get(bound, 0.0) + sample.value
                elif family.name == "kvpilot_alerts_rule_group_iterations_missed" and sample.name.endswith("_total"):
                    missed += sample.value
    p99 = next((b for b in sorted(buckets) if count and buckets[b] >= 0.99 * count), math.inf)
    return {
        "alert_rule_interval_s": config.rule_interval_s,
        "alert_evaluations": int(count),
        "alert_evaluation_mean_s": _round(total / count if count else None, 4),
        "alert_evaluation_p99_le_s": p99 if p99 < math.inf else None,  # None: past the last bucket, or none ran
        "alert_iterations_missed": int(missed),
    }


def _quiet_evaluations(engine: Any, expr: Any, interval_s: float, rounds: int = 20) -> dict[str, Any]:
    """The paging rule's expression evaluated `rounds` times once the fleet has stopped (the senders and the page
    reader done; the lease holder still evaluating on its interval): one evaluation's time (`_wall`: this
    process's CPU, the database's and the round trips) and this thread's CPU in it, and the share of one core the
    rule's interval asks for at that time (an upper bound: the wall time counts waits as well as work)."""
    from alerts.expr_eval import CachingSource, Evaluator
    from alerts.sql_source import SqlSource

    source = SqlSource(engine)
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.thread_time()
        Evaluator(CachingSource(source)).evaluate(expr, time.time())  # a fresh cache per evaluation, as a tick
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    wall_p50 = nearest_rank(walls, 0.5)
    return {
        "alert_evaluation_quiet_p50_s": _round(wall_p50, 4),
        "alert_evaluation_quiet_cpu_p50_s": _round(nearest_rank(cpus, 0.5), 4),
        "alert_evaluation_core_share": _round(wall_p50 / interval_s if wall_p50 is not None else None),
    }


def _scrape_figures(engine: Any, scraped_s: float) -> dict[str, Any]:
    """Points stored per second since the targets were registered (the scraper ran that long)."""
    points = _scalar(engine, "SELECT count(*) FROM series_points WHERE target_id IS NOT NULL")
    up = _scalar(engine, "SELECT count(*) FROM scrape_targets WHERE up")
    return {"scrape_targets_up": up, "scrape_points": points, "scrape_points_per_s": round(points / scraped_s, 1)}


def tiny_config() -> FleetConfig:
    """Seconds, not minutes: what the test runs."""
    return replace(
        FleetConfig(),
        instances=24,
        senders=2,
        sender_threads=2,
        live_s=12.0,
        history_events_per_instance=20,
        ceiling_batches=2,
        dcgm_nodes=2,
        scrape_interval_s=1.0,
        otlp_share=0.25,
        alert_trials=2,
        engines_per_relay=4,
        saturation_s=3.0,
        first_contact_lead_s=4.0,
    )
