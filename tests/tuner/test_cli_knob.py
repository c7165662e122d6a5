"""`kvpilot tune study --knob`: a study over exactly the knobs named, as the diagnosis page's commands run it."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

from typer.testing import CliRunner

from collector import queries as q
from collector.db import make_engine
from collector.ingest import parse_batch, store_batch
from kvpilot.cli import app
from tests.collector import evfactory as ev

from .conftest import tiny_profile

runner = CliRunner()
SMALL = ["--requests", "20", "--scale", "16", "--output-range", "4,16"]


def _profile(tmp_path: Path) -> str:
    path = tmp_path / "tiny.json"
    tiny_profile().save(path)
    return str(path)


def test_study_over_one_knob_searches_only_that_knob(sqlite_url: str, tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    args = ["tune", "study", "--knob", "scheduler.preemption_mode", "--trials", "3", "--profile", _profile(tmp_path)]
    res = runner.invoke(app, [*args, *SMALL, "--db-url", sqlite_url, "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert set(summary["best_params"]) == {"scheduler.preemption_mode"}


def test_a_knob_outside_the_space_exits_2_naming_it(sqlite_url: str) -> None:
    res = runner.invoke(app, ["tune", "study", "--knob", "warmup.requests", "--db-url", sqlite_url])
    assert res.exit_code == 2
    assert "knob: warmup.requests not in the search space; one of block_policy" in res.output


def test_the_diagnosis_study_command_runs_on_the_instance_s_own_traffic(sqlite_url: str, tmp_path: Path) -> None:
    """The command a finding carries, as printed, with the test's profile and a smaller size appended."""
    now = time.time()
    events = [
        ev.request(0, ts=now - 300 + 2.0 * n, request_id=f"q{n}", prompt_tokens=40 + n % 50, output_tokens=8)
        for n in range(60)
    ]
    engine = make_engine(sqlite_url)
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=1000), idempotency_key=None, content=raw)
    found = q.mixed_lengths(engine, instance="e0", start=now - 600, end=now, now=now)
    engine.dispose()
    args = shlex.split(found.study_command or "")
    assert args[0] == "kvpilot" and args[args.index("--hours") + 1] == "1"
    out = tmp_path / "s.json"
    extra = ["--trials", "2", "--profile", _profile(tmp_path), *SMALL, "--db-url", sqlite_url, "--json", str(out)]
    res = runner.invoke(app, [*args[1:], *extra], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert summary["workload"]["kind"] == "stored" and summary["study"] == "diagnosis-mixed-lengths-e0"
    assert summary["workload"]["instance"] == "e0" and summary["workload"]["requests"] == 20  # the latest 20
    assert summary["trials"] + summary["duplicates"] == 2  # the appended --trials wins
    assert set(summary["best_params"]) == {"scheduler.prefill_chunk_tokens"}
