"""`kvpilot bench fleet` end to end on a tiny fleet: 2 collectors on one PostgreSQL, senders, OTLP, a scrape,
two evaluators and the page reads; every figure present and nothing acknowledged lost."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from benchmarks import fleet_load
from benchmarks.fleet import run_fleet_bench, tiny_config
from kvpilot.cli import app
from tests.conftest import PG_ENV

KEYS = (
    "instances",
    "collectors",
    "events_per_s",
    "copy_ceiling_events_per_s",
    "ratio",
    "ingest_lag_p99_s",
    "alert_delivery_p99_s",
    "query_p95_s",
    "db_mb_per_million_events",
    "lost",
    "load_average",
)


@pytest.mark.postgres
def test_tiny_fleet_reports_every_figure_and_loses_nothing(_pg_schema_url: str) -> None:
    messages: list[str] = []
    result = run_fleet_bench(os.environ[PG_ENV], tiny_config(), progress=messages.append)
    assert set(KEYS) <= set(result), set(KEYS) - set(result)
    assert result["instances"] == 24 and result["collectors"] == 2
    assert result["lost"] == 0 and result["unacked_events"] == 0, result["sender_failures"]
    assert sum(result["acked_events"].values()) > 1000 and result["events_per_s"] > 0
    assert result["acked_events"]["request"] > 0 and result["otlp_instances"] == 6
    # the OTLP engines' own exporters: no span dropped from their queues, every request acknowledged is stored
    assert result["spans_dropped"] == 0 and result["stored_events"]["request"] == result["acked_events"]["request"]
    assert result["copy_ceiling_events_per_s"] > 0 and len(result["copy_ceilings_events_per_s"]) == 2
    # the ratio is the collectors' capacity (the fleet offered 4x its rates) over the ceiling, not the fleet's share
    assert result["saturated_events_per_s"] > 0 and result["saturation_batches"] > 0
    assert result["saturation_failures"] == []  # its own keys and ids: nothing refused as a replay of the live run
    assert result["ratio"] == round(result["saturated_events_per_s"] / result["copy_ceiling_events_per_s"], 3)
    assert result["saturation_offered_events_per_s"] > result["events_per_s"]
    share = result["offered_events_per_s"] / result["saturated_events_per_s"]
    assert result["offered_share_of_capacity"] == pytest.approx(share, abs=1e-3)
    overloaded = any("of what the collectors take" in m for m in messages)
    assert overloaded == (result["offered_share_of_capacity"] >= 0.9)
    assert result["alert_trials_planned"] == 2 and result["alert_trials"] >= 1
    assert result["alerts_delivered"] == result["alert_trials"] and result["alert_delivery_p99_s"] > 0
    assert 0 < result["alert_stored_p99_s"] <= result["alert_delivery_p99_s"]
    assert 0 < result["alert_evaluated_and_delivered_p99_s"] <= result["alert_delivery_p99_s"]
    assert result["alert_duplicate_posts"] == 0  # two evaluators, one lease: one notification each
    # the rule ran on its 250-ms interval (the loop wakes when it falls due), its cost from the evaluators' metrics
    assert result["alert_rule_interval_s"] == 0.25 and result["alert_evaluations"] >= 12 / 0.25 / 2
    assert 0 < result["alert_evaluation_mean_s"] <= (result["alert_evaluation_p99_le_s"] or 10.0)
    assert result["alert_iterations_missed"] >= 0
    # the hot engines pushed through a node relay, every push stored (about one a second each over the 12 s)
    assert set(result["alert_relay_pushes"]) == {"202"} and result["alert_relay_pushes"]["202"] >= 2 * 5
    assert 0 < result["alert_evaluation_quiet_cpu_p50_s"] <= result["alert_evaluation_quiet_p50_s"]
    share = result["alert_evaluation_quiet_p50_s"] / 0.25
    assert result["alert_evaluation_core_share"] == pytest.approx(share, abs=0.002)
    assert set(result["query_p95_s"]) == {"overview", "latency", "kv", "status --instance"}
    assert all(v is not None and v > 0 for v in result["query_p95_s"].values())
    assert result["scrape_targets_up"] == 2 and result["scrape_points_per_s"] > 0
    assert result["db_mb_per_million_events"] > 0 and result["ingest_lag_p99_s"] > 0
    # every engine's first push went before each timed run (its instance and run claimed), and is stored too
    assert 0 < result["first_contact_s"] < 4.0 and 0 < result["saturation_first_contact_s"] < 4.0
    # the lag's parts: the oldest event's age when its push left, then the push to its answer
    assert 0 < result["ingest_age_at_send_p50_s"] <= result["ingest_age_at_send_p99_s"] <= result["ingest_lag_p99_s"]
    assert 0 < result["ingest_answer_p50_s"] <= result["ingest_answer_p99_s"] <= result["ingest_lag_p99_s"]
    # and where the answers' tail fell: per collector, per 10 s of the run (12 s here: two windows or three)
    by_collector, by_window = result["ingest_answer_p99_by_collector_s"], result["ingest_answer_p99_by_10s"]
    assert len(by_collector) == 2 and all(p > 0 for p in by_collector)
    assert min(by_collector) <= result["ingest_answer_p99_s"] <= max(by_collector)
    assert len(by_window) >= 2 and all(p is not None and p > 0 for p in by_window)
    # the live senders outrank the collectors where the OS grants it (root here and in CI), so the lag is theirs
    if os.geteuid() == 0:
        assert result["sender_sched"] == ["rr 1"]
    else:
        assert all(how.startswith("nice ") for how in result["sender_sched"])
    assert any("sender processes" in m for m in messages) and any("saturation" in m for m in messages)


def test_every_engine_of_the_history_pushes_under_its_own_run_id() -> None:
    """As engines do (each draws a run id when it starts): one id shared by the fleet put every insert of the
    run index on the same leaf pages, a cost no fleet pays; the bench counts a run's rows by its prefix."""
    runs: dict[str, set[str]] = {}
    for batch in fleet_load.history_batches(3, 40, end=1_800_000_000.0, slices=2):
        for text in batch:
            for event in json.loads("[" + text + "]"):
                runs.setdefault(event["instance"], set()).add(event["run_id"])
    assert runs == {name: {fleet_load.run_of(fleet_load.HISTORY_RUN, name)} for name in runs} and len(runs) == 3
    prefix = fleet_load.run_of(fleet_load.HISTORY_RUN, "")
    assert all(run.startswith(prefix) for ids in runs.values() for run in ids)


@pytest.mark.postgres
def test_a_failure_before_the_senders_is_reported_as_itself(_pg_schema_url: str, monkeypatch) -> None:
    """A failure while the run is set up (here, a rule file the evaluators refuse) ends the bench with that error,
    not with one from stopping the page reader that never started."""
    from alerts.rules import RuleFileError
    from benchmarks import fleet

    monkeypatch.setattr(fleet, "RULES", fleet.RULES.replace("interval: {interval}", "interval: 0.5s"))
    with pytest.raises(RuleFileError, match="not a valid duration"):
        run_fleet_bench(os.environ[PG_ENV], tiny_config(), progress=lambda _: None)


def test_unreachable_postgres_is_refused_with_a_clear_message() -> None:
    out = CliRunner().invoke(app, ["bench", "fleet", "--pg-url", "postgresql+psycopg://postgres@127.0.0.1:9/none"])
    assert out.exit_code == 2
    assert "kvpilot bench fleet: PostgreSQL at postgresql+psycopg://postgres@127.0.0.1:9/none" in out.output
    assert "Traceback" not in out.output


def test_collectors_option_gives_every_collector_a_sender() -> None:
    from benchmarks.fleet import FleetConfig

    assert (FleetConfig.for_run(True).collectors, FleetConfig.for_run(True).senders) == (2, 2)
    three = FleetConfig.for_run(True, collectors=3)
    assert (three.collectors, three.senders, three.live_s) == (3, 3, 60.0)
    assert FleetConfig.for_run(False, collectors=1).senders == 2


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--collectors", "0"], "--collectors"),
        (["--collectors", "9"], "--collectors"),
        (["--rule-interval", "0.5s"], "--rule-interval"),  # not a Prometheus duration
        (["--rule-interval", "100ms"], "--rule-interval"),
        (["--rule-interval", "2m"], "--rule-interval"),
    ],
)
def test_collectors_out_of_range_is_refused_naming_the_option(args: list[str], field: str) -> None:
    out = CliRunner().invoke(app, ["bench", "fleet", *args])
    assert out.exit_code == 2 and field in out.output
    assert "Traceback" not in out.output


def test_a_collector_without_a_sender_is_refused_before_anything_starts() -> None:
    from dataclasses import replace

    from benchmarks.fleet import FleetBenchError, FleetConfig

    lonely = replace(FleetConfig.for_run(True, collectors=3), senders=2)
    with pytest.raises(FleetBenchError, match="without traffic"):
        run_fleet_bench("postgresql+psycopg://postgres@127.0.0.1:9/none", lonely)


def test_sigterm_ends_the_bench_through_its_cleanup() -> None:
    """Under `timeout` (SIGTERM) the bench's `finally` blocks run, as on Ctrl-C: its collectors are stopped and its
    database dropped instead of left behind."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from benchmarks.cli import _terminated_as_exit\n"
        "try:\n"
        "    with _terminated_as_exit():\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(10)\n"
        "finally:\n"
        "    print('cleaned up', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and done.stdout == "cleaned up\n", done.stderr
