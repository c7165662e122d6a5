"""`kvpilot demo`: the whole loop on embedded defaults, in one process tree, with one command.

collector (SQLite) <- engine (HTTP sink) <- load (mixed, then a burst); the alert evaluator watches the
stored metrics and pages a local webhook sink when the burst pushes KV memory over 90%. The burst lasts
until that page arrived (bounded), and the summary says why when it did not fire or resolve. A short
tuning job on the simulator studies the engine's own config and proposes only the changes that matter;
the dashboard serves it all (not started with --exit). Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import typer

DATA_DIR = Path("kvpilot-data")

log = logging.getLogger("kvpilot.demo")


def _say(msg: str) -> None:
    typer.echo(f"[demo] {msg}", err=True)


def demo_engine_config(collector_url: str, port: int, run_id: str, admin_token: str) -> dict:
    """The simulator's model (so the tuning step studies this very config) and a small hot KV pool:
    3,072 tokens, which a burst on 2 CPU cores really fills."""
    from kvpilot.demo_tune import profile_model

    return {
        "device": "cpu",
        "model": profile_model(),
        "cache": {"hot_bytes": 6 * 2**20, "cold_bytes": 48 * 2**20, "block_size": 32},
        "scheduler": {"max_num_seqs": 32, "queue_limit": 400, "preemption_mode": "swap"},
        "warmup": {"requests": 4, "prompt_tokens": 32, "max_tokens": 4},
        "server": {"host": "127.0.0.1", "port": port, "admin_token": admin_token},
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
        self._stops: list[tuple[str, Callable[[], object]]] = []

    def push(self, name: str, stop: Callable[[], object]) -> None:
        self._stops.append((name, stop))

    def close(self, only: str | None = None) -> None:
        """Stop everything (newest first), or only the thing named `only`."""
        for name, stop in [s for s in reversed(self._stops) if only in (None, s[0])]:
            self._stops.remove((name, stop))
            try:
                stop()
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
    from engine.config import EngineConfig
    from engine.factory import build_app
    from plumbing.serving import serve_in_thread

    app = build_app(EngineConfig.from_dict(cfg, source="demo engine config"))
    server = serve_in_thread(app, port=cfg["server"]["port"], name="kvpilot-demo-engine", timeout_s=60.0)
    stack.push("engine", lambda: server.stop(15.0))
    return server.url


def _fresh_admin_token() -> str:
    """A new admin token each run (never a well-known one), kept in kvpilot-data/admin-token (mode 0600) so
    `kvpilot tune apply --admin-token "$(cat kvpilot-data/admin-token)"` can reach this run's engine."""
    import os
    import secrets

    token = secrets.token_urlsafe(24)
    path = DATA_DIR / "admin-token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def _start_dashboard(db_url: str, engine_url: str, admin_token: str, port: int, stack: _Stack) -> str | None:
    """Streamlit in a child process, so its reruns never compete with the engine loop for the GIL."""
    import os
    import socket

    from kvpilot.cli_dashboard import HEALTH_PATH, start_dashboard
    from plumbing.process import ProcessStartError, free_port, stop_process, wait_healthy

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:  # taken: take any free port instead
            port = free_port()
    from alerts.rules import DEMO_RULES

    # The dashboard child reads these: this run's engine and its admin token (a fresh one per run), and the
    # demo's rules, so its charts draw the lines the demo's alerts fire at.
    os.environ["KVPILOT_ENGINE_URL"] = engine_url
    os.environ["KVPILOT_ADMIN_TOKEN"] = admin_token
    os.environ.setdefault("KVPILOT_DASHBOARD_RULE_FILES", str(DEMO_RULES))
    log_path = DATA_DIR / "dashboard.log"
    proc = start_dashboard(db_url, port=port, log_path=log_path)

    stack.push("dashboard", lambda: stop_process(proc))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url + HEALTH_PATH, proc, timeout_s=60, what="dashboard", log_path=log_path, poll_s=0.25)
    except ProcessStartError as exc:
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
    from collector.server import run_in_thread
    from collector.settings import CollectorSettings
    from kvpilot import demo_alerts as DA
    from kvpilot.demo_load import drive_demo_load
    from kvpilot.demo_report import dashboard_line, print_summary, wait_for_stored
    from kvpilot.demo_tune import run_demo_tuning
    from plumbing.process import free_port

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
            admin_token = _fresh_admin_token()
            engine_cfg = demo_engine_config(collector.url, free_port(), run_id, admin_token)
            engine_url = _serve_engine(engine_cfg, stack)
            _say(f"engine on {engine_url} (run {run_id}; random weights: the text is noise, the serving is real)")
            # With --exit the dashboard would be stopped before anyone could open it: it is not started.
            dash_url = _start_dashboard(db_url, engine_url, admin_token, dashboard_port, stack) if keep else None
            started = time.time()

            def payloads() -> list[dict]:
                return [n.payload for n in list(sink.received)]

            report = asyncio.run(
                drive_demo_load(
                    engine_url,
                    duration_s=duration_s,
                    stop=stop,
                    say=_say,
                    burst_done=lambda: DA.fired(payloads()),
                )
            )
            alert_lines = _alert_outcome(db_url, payloads, started, stop)
            counts = wait_for_stored(
                db_url, run_id=run_id, since=started, expect=report["answered"] + report["refused"]
            )
            print_summary(report, counts, run_id, alert_lines)
            if not keep:  # the tuner's simulated trials land in the same database: no pages about them
                stack.close(only="alert evaluator")
            if not stop.is_set():
                run_demo_tuning(db_url, engine_cfg, data_dir=DATA_DIR, since=started, say=_say)
            typer.echo(dashboard_line(dash_url, keep_running=keep, db_url=db_url))
            if keep and not stop.is_set():
                _say(f"everything keeps running; dashboard at {dash_url}. Ctrl-C stops.")
                while not stop.is_set():
                    stop.wait(1.0)
        finally:
            stack.close()
    return 0


def _alert_outcome(db_url: str, payloads: Callable[[], list[dict]], started: float, stop: threading.Event) -> list[str]:
    """Wait (bounded) for MemoryPressure to resolve; lines saying what it did, and why not when it did not."""
    from alerts.rules import DEMO_RULES, load_rule_files
    from kvpilot import demo_alerts as DA

    rule = next(r for g in load_rule_files([DEMO_RULES]) for r in g.rules if r.name == DA.ALERT)
    if DA.fired(payloads()):
        _say(f"waiting for {DA.ALERT} to resolve (at most 30 s)")
        DA.wait_until(lambda: DA.resolved(payloads()), timeout_s=30, stop=stop.is_set)
    lines = [f"alert {DA.history(payloads())}"]
    if DA.resolved(payloads()):
        return lines
    stretches = DA.read_stretches(db_url, instance=DA.INSTANCE, start=started, end=time.time() + 1)
    if DA.fired(payloads()):
        why = DA.why_not_resolved(stretches, threshold=DA.THRESHOLD)
        return [*lines, f"alert {DA.ALERT} did not resolve within 30 s: {why}"]
    why = DA.why_not_fired(stretches, threshold=DA.THRESHOLD, for_s=rule.for_s)
    return [f"alert {DA.ALERT} did not fire: {why}"]
