"""`kvpilot demo`: the whole loop on embedded defaults, in one process tree, with one command.

collector (SQLite) <- engine (HTTP sink) <- load (mixed, then a burst); the alert evaluator watches the
stored metrics and pages a local webhook sink when the burst pushes KV memory over 90%; a short tuning
job on the simulator writes a proposal; the dashboard serves it all. Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import typer

DATA_DIR = Path("kvpilot-data")

log = logging.getLogger("kvpilot.demo")


def _say(msg: str) -> None:
    typer.echo(f"[demo] {msg}", err=True)


def demo_engine_config(collector_url: str, port: int, run_id: str) -> dict:
    """A small model and a small hot KV pool, so a burst on 2 CPU cores really fills memory."""
    return {
        "device": "cpu",
        "model": {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256, "max_position": 2048},
        "cache": {"hot_bytes": 4 * 2**20, "cold_bytes": 24 * 2**20, "block_size": 32},
        "scheduler": {"max_num_seqs": 32, "queue_limit": 400, "preemption_mode": "swap"},
        "warmup": {"requests": 4, "prompt_tokens": 32, "max_tokens": 4},
        "server": {"host": "127.0.0.1", "port": port, "admin_token": "demo-admin"},
        "telemetry": {
            "instance": "demo-engine",
            "run_id": run_id,
            "sink": "http",
            "collector_url": collector_url,
            "sample_interval_s": 0.5,
            "spool_dir": str(DATA_DIR / "spool"),
            "http_flush_interval_s": 0.25,
        },
    }


class _Stack:
    """Things started, stopped in reverse order whatever happens."""

    def __init__(self) -> None:
        self._stops: list[tuple[str, object]] = []

    def push(self, name: str, stop: object) -> None:
        self._stops.append((name, stop))

    def close(self) -> None:
        while self._stops:
            name, stop = self._stops.pop()
            try:
                stop()  # type: ignore[operator]
            except Exception as exc:  # a failing stop must not keep the others running
                log.warning("stopping %s failed: %s", name, exc)


@contextlib.contextmanager
def _interruptible() -> Iterator[threading.Event]:
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: object) -> None:
        _say("Ctrl-C: stopping everything")
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _serve_engine(cfg: dict, stack: _Stack) -> str:
    import uvicorn

    from engine.config import EngineConfig
    from engine.factory import build_app

    app = build_app(EngineConfig.from_dict(cfg, source="demo engine config"))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=cfg["server"]["port"], log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="kvpilot-demo-engine", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("demo engine did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(15)

    stack.push("engine", stop)
    return f"http://127.0.0.1:{cfg['server']['port']}"


def _tune(db_url: str) -> None:
    """A short nightly job on the simulator, on the workload the collector just stored."""
    import yaml

    from tuner.nightly import run_nightly
    from tuner.workloads import WorkloadOptions

    current = DATA_DIR / "current-config.yaml"
    # The tuner's CPU profile is calibrated for its own model; the current settings under study are the
    # engine defaults with a deliberately tight batch, as a hand-tuned config left over from a small GPU.
    current.write_text(
        yaml.safe_dump({"scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 512, "prefill_chunk_tokens": 256}})
    )
    # The stored traffic at the rate it arrived: the shipped CPU profile is calibrated on this machine class, and
    # sped up on top of the demo's own burst no config meets the SLOs (the study then has nothing to propose).
    _say("tuning: 12 trials on the simulator, the last hour of requests replayed as they arrived, then a confirmation")
    result = run_nightly(
        db_url=db_url,
        out_dir=DATA_DIR / "proposals",
        trials=12,
        workload="collector",
        options=WorkloadOptions(hours=1, requests=150, time_scale=1.0),
        instance="demo-engine",
        confirm_seeds=2,
        config_path=current,
        progress=False,
    )
    if result.proposal is None:
        typer.echo(f"  tuning: no proposal ({result.decision})")
    else:
        typer.echo(
            f"  tuning: proposal {result.proposal.id} ({result.decision}); "
            f"files: {', '.join(str(p) for p in result.files.values())}"
        )


def _start_dashboard(db_url: str, engine_url: str, port: int, stack: _Stack) -> str | None:
    """Streamlit in a child process, so its reruns never compete with the engine loop for the GIL."""
    import os
    import socket

    from collector.server import free_port, stop_process
    from kvpilot.cli_dashboard import start_dashboard, wait_until_healthy

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:  # taken: take any free port instead
            port = free_port()
    os.environ.setdefault("KVPILOT_ENGINE_URL", engine_url)
    os.environ.setdefault("KVPILOT_ADMIN_TOKEN", "demo-admin")
    proc = start_dashboard(db_url, port=port, log_path=DATA_DIR / "dashboard.log")

    stack.push("dashboard", lambda: stop_process(proc))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout_s=60, proc=proc)
    except (RuntimeError, TimeoutError) as exc:
        log.warning("dashboard did not start: %s", exc)
        return None
    _say(f"dashboard on {url}")
    return url


def run_demo(duration_s: float = 20.0, *, keep_running: bool | None = None, dashboard_port: int = 8501) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from alerts.rules import DEMO_RULES
    from alerts.runner import start_evaluator
    from alerts.sink import run_webhook_sink
    from collector.db import upgrade
    from collector.server import free_port, run_in_thread
    from collector.settings import CollectorSettings
    from kvpilot.demo_load import drive_demo_load

    DATA_DIR.mkdir(exist_ok=True)
    db_path = (DATA_DIR / "kvpilot.db").resolve()
    db_url = f"sqlite:///{db_path}"
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    stack = _Stack()
    keep = sys.stdin.isatty() if keep_running is None else keep_running
    with _interruptible() as stop:
        try:
            _say(f"database {db_path}: migrating to head")
            upgrade(db_url)
            collector = run_in_thread(CollectorSettings(db_url=db_url, port=0, log_level="warning"))
            stack.push("collector", collector.stop)
            _say(f"collector on {collector.url}")
            sink = run_webhook_sink(port=0)
            stack.push("webhook sink", sink.stop)
            evaluator = start_evaluator(
                db_url, rule_files=[DEMO_RULES], webhook_urls=[sink.url], group_wait_s=0, group_interval_s=1
            )
            stack.push("alert evaluator", evaluator.stop)
            _say(f"alert evaluator on {DEMO_RULES.name}, paging the webhook sink at {sink.url}")
            engine_url = _serve_engine(demo_engine_config(collector.url, free_port(), run_id), stack)
            _say(f"engine on {engine_url} (run {run_id})")
            dash_url = _start_dashboard(db_url, engine_url, dashboard_port, stack)
            report = asyncio.run(drive_demo_load(engine_url, duration_s=duration_s, stop=stop, say=_say))
            _say("waiting for alerts to resolve")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not stop.is_set():
                statuses = {(a["labels"]["alertname"], a["status"]) for n in sink.received for a in n.payload["alerts"]}
                fired = {name for name, status in statuses if status == "firing"}
                resolved = {name for name, status in statuses if status == "resolved"}
                if fired and fired <= resolved:
                    break
                time.sleep(0.5)
            _print_summary(report, [n.payload for n in sink.received], db_url, run_id)
            if not stop.is_set():
                _tune(db_url)
            typer.echo(f"  dashboard: {dash_url or 'did not start (see kvpilot-data/dashboard.log)'}")
            if keep and not stop.is_set():
                _say(f"everything keeps running; dashboard at {dash_url}. Ctrl-C stops.")
                while not stop.is_set():
                    stop.wait(1.0)
        finally:
            stack.close()
    return 0


def _print_summary(report: dict, notifications: list[dict], db_url: str, run_id: str) -> None:
    from sqlalchemy import func, select

    from collector.db import make_engine
    from collector.schema import RequestRow, StepRow

    engine = make_engine(db_url)
    with engine.connect() as conn:
        stored_requests = conn.execute(
            select(func.count()).select_from(RequestRow).where(RequestRow.run_id == run_id)
        ).scalar_one()
        stored_steps = conn.execute(
            select(func.count()).select_from(StepRow).where(StepRow.run_id == run_id)
        ).scalar_one()
    engine.dispose()
    typer.echo("")
    typer.echo("kvpilot demo summary")
    typer.echo(
        f"  requests sent / answered / refused (429): {report['sent']} / {report['answered']} / {report['refused']}"
    )
    typer.echo(f"  output tokens: {report['output_tokens']}  throughput: {report['tokens_per_s']:.0f} tokens/s")
    typer.echo(f"  e2e p50 / p99: {report['p50_s']:.3f} s / {report['p99_s']:.3f} s")
    typer.echo(f"  ttft p50: {report['ttft_p50_s']:.3f} s")
    typer.echo(f"  stored in SQL (run {run_id}): {stored_requests} requests, {stored_steps} steps")
    for n in notifications:
        for a in n["alerts"]:
            typer.echo(f"  alert {a['labels']['alertname']:<16} {a['status']:<8} startsAt {a['startsAt']}")
    if not notifications:
        typer.echo("  alerts: none arrived at the webhook sink")
