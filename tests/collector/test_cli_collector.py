"""`kvpilot db ...` and `kvpilot collector ...` (the typer apps of kvpilot/cli_collector.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import text
from typer.testing import CliRunner

from collector.db import head_revision, make_engine
from kvpilot.cli_collector import collector_app, db_app
from tests.collector import evfactory as ev

runner = CliRunner()


def test_upgrade_then_current(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    before = runner.invoke(db_app, ["current", "--db-url", url])
    assert before.exit_code == 1 and "(not migrated)" in before.output
    up = runner.invoke(db_app, ["upgrade", "--db-url", url])
    assert up.exit_code == 0, up.output
    assert head_revision() in up.output
    after = runner.invoke(db_app, ["current", "--db-url", url])
    assert after.exit_code == 0 and after.output.count(head_revision()) == 2


def test_serve_refuses_an_unmigrated_database(tmp_path: Path) -> None:
    env = {**os.environ, "KVPILOT_DB_URL": f"sqlite:///{tmp_path / 'raw.db'}", "KVPILOT_PORT": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "collector", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "kvpilot db upgrade" in proc.stderr


def test_serve_refuses_public_bind_without_token(sqlite_url: str) -> None:
    result = runner.invoke(collector_app, ["serve", "--db-url", sqlite_url, "--host", "0.0.0.0", "--no-scrape"])
    assert result.exit_code == 1
    assert "KVPILOT_INGEST_TOKEN" in result.output


def test_import_jsonl_is_idempotent(sqlite_url: str, tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in ev.mixed(23)) + "\n\n")
    first = runner.invoke(collector_app, ["import", str(path), "--db-url", sqlite_url, "--batch-events", "10"])
    assert first.exit_code == 0, first.output
    assert "stored 23 events, 0 already present" in first.output
    again = runner.invoke(collector_app, ["import", str(path), "--db-url", sqlite_url, "--batch-events", "10"])
    assert "stored 0 events, 23 already present" in again.output
    engine = make_engine(sqlite_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM steps")).scalar_one() == 6
    engine.dispose()


def test_import_names_the_bad_event(sqlite_url: str, tmp_path: Path) -> None:
    events = ev.mixed(5)
    events[3]["usage_after"] = 3.0
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events))
    result = runner.invoke(collector_app, ["import", str(path), "--db-url", sqlite_url])
    assert result.exit_code == 1
    assert "event 4.usage_after" in result.output


def test_prune_command(sqlite_url: str) -> None:
    result = runner.invoke(db_app, ["prune", "--db-url", sqlite_url, "--raw-days", "7", "--downsample-days", "30"])
    assert result.exit_code == 0, result.output
    assert "deleted:" in result.output
    bad = runner.invoke(db_app, ["prune", "--db-url", sqlite_url, "--raw-days", "7", "--downsample-days", "3"])
    assert bad.exit_code == 1
