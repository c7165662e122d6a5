"""Rotating an engine's secret under load, through the real CLI against a collector in a child process:
no push is refused as 409 (the instances belong to the identity's name, not to a secret) and no event
is lost (every emitted event is a stored row).

Two engine styles move to the new secret: one reads its token from a file (`telemetry.collector_token_file`:
no restart), one restarts with the new secret on the same spool directory.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

from collector.db import make_engine
from collector.schema import StepRow
from collector.server.process import start_subprocess
from collector.settings import CollectorSettings
from engine.events import StepEvent
from engine.http_sink import HttpSink
from tests.collector import evfactory as ev

SINK = {"batch_size": 100, "flush_interval_s": 0.05, "backoff_initial_s": 0.05, "backoff_max_s": 0.2}


def tokens_cli(*args: str, file: Path) -> str:
    """`kvpilot collector tokens ARGS --file FILE` in a child process; its stdout (a secret, for add/rotate)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "collector", "tokens", *args, "--file", str(file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


class Sender:
    """Emits step events of one instance into whatever sink it holds now, about `rate` a second."""

    def __init__(self, sink: HttpSink, instance: str, rate: float = 1500.0) -> None:
        self.sink, self.instance, self.rate = sink, instance, rate
        self.emitted = 0
        self.lock = threading.Lock()  # held while the sink is swapped (a restart)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                for _ in range(15):
                    i = self.emitted
                    self.sink.emit(StepEvent(**ev.step(i, instance=self.instance, run_id="r1")))
                    self.emitted += 1
            time.sleep(15 / self.rate)


def secret_ids(file: Path, name: str) -> list[str]:
    return [line.split()[1] for line in tokens_cli("list", file=file).splitlines() if line.startswith("  secret ")]


def test_rotation_under_load_loses_nothing_and_is_never_409(sqlite_url: str, tmp_path: Path) -> None:
    file = tmp_path / "tokens.json"
    old = tokens_cli("add", "engine-a", "--role", "ingest", file=file)
    [old_id] = secret_ids(file, "engine-a")
    token_file = tmp_path / "engine-a.token"
    token_file.write_text(old + "\n")
    settings = CollectorSettings(
        db_url=sqlite_url,
        tokens_file=file,
        scrape_enabled=False,
        log_level="warning",
        raw_retention_days=ev.REPLAY_RETENTION_DAYS,
    )
    collector = start_subprocess(settings, log_path=tmp_path / "collector.log")
    sinks: list[HttpSink] = []
    try:
        by_file = HttpSink(collector.url, token_file=token_file, spool_dir=tmp_path / "spool-a0", **SINK)
        restarted = HttpSink(collector.url, token=old, spool_dir=tmp_path / "spool-a1", **SINK)
        sinks += [by_file, restarted]
        a0, a1 = Sender(by_file, "engine-a-0"), Sender(restarted, "engine-a-1")
        time.sleep(1.5)
        assert by_file.sent > 0 and restarted.sent > 0

        new = tokens_cli("rotate", "engine-a", file=file)
        time.sleep(0.5)  # both secrets valid: the old one still pushes
        staged = token_file.with_suffix(".tmp")
        staged.write_text(new + "\n")
        staged.replace(token_file)  # the engine's token file changes atomically (a mounted secret)
        with a1.lock:  # the other engine restarts with the new secret, on the same spool
            assert restarted.wait_drained(10.0)
            restarted.close()
            restarted = HttpSink(collector.url, token=new, spool_dir=tmp_path / "spool-a1", **SINK)
            sinks.append(restarted)
            a1.sink = restarted
        sent_after_switch = by_file.sent
        deadline = time.monotonic() + 10
        while by_file.sent <= sent_after_switch and time.monotonic() < deadline:
            time.sleep(0.02)  # a batch went with the new secret: the old one may go
        assert by_file.sent > sent_after_switch

        tokens_cli("revoke", "engine-a", "--secret-id", old_id, file=file)
        time.sleep(1.5)  # still under load after the revocation
        assert (
            httpx.post(
                f"{collector.url}/v1/ingest", content=b"{}", headers={"Authorization": f"Bearer {old}"}
            ).status_code
            == 403
        )  # the old secret is dead
        for sender in (a0, a1):
            sender.stop.set()
            sender.thread.join(5)
        for sink in (by_file, restarted):
            assert sink.wait_drained(20.0)
        metrics = httpx.get(f"{collector.url}/metrics").text
    finally:
        for sink in sinks:
            sink.close()
        collector.stop()

    refused = [line for line in metrics.splitlines() if line.startswith("kvpilot_collector_ingest_rejected_total{")]
    assert not any('reason="instance_owned"' in line and not line.endswith(" 0.0") for line in refused), refused
    for sink in sinks:
        assert sink.auth_failures == 0 and sink.rejected == 0
        assert not any(sink.dropped_by_reason().values()), sink.dropped_by_reason()
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            stored = dict(conn.execute(select(StepRow.instance, func.count()).group_by(StepRow.instance)).all())
    finally:
        engine.dispose()
    assert a0.emitted > 1000 and a1.emitted > 1000
    assert stored == {"engine-a-0": a0.emitted, "engine-a-1": a1.emitted}
