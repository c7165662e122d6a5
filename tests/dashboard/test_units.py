"""Time windows, config diffs, alert history parsing and the CLI command line: plain functions."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dashboard import timewin, transform
from kvpilot.cli_dashboard import app_path, dashboard_command, dashboard_url


def test_bucket_width_keeps_charts_under_the_target_and_round() -> None:
    assert timewin.pick_bucket_s(600) == 5.0
    assert timewin.pick_bucket_s(3600) == 15.0
    assert timewin.pick_bucket_s(7 * 86400) == 3600.0
    assert timewin.pick_bucket_s(400 * 86400) == 2 * 86400.0
    for span in (1, 59, 600, 3601, 86400, 30 * 86400):
        width = timewin.pick_bucket_s(span)
        assert span / width <= timewin.TARGET_POINTS


def test_resolve_presets() -> None:
    now = 1_800_000_000.0
    assert timewin.resolve("Last hour", now=now, run_span=None) == timewin.Window(now - 3600, now, "Last hour")
    whole = timewin.resolve("Whole run", now=now, run_span=(100.5, 200.25))
    assert (whole.start, whole.end) == (100.0, 201.0)  # the last event (ts < end) is inside
    assert timewin.resolve("Whole run", now=now, run_span=None).start == now - 3600
    assert timewin.resolve("Custom", now=now, run_span=None, custom=(1.0, 2.0)).span_s == 1.0
    with pytest.raises(ValueError, match="end after its start"):
        timewin.resolve("Custom", now=now, run_span=None, custom=(2.0, 1.0))
    with pytest.raises(ValueError, match="unknown time range"):
        timewin.resolve("Yesterday", now=now, run_span=None)


def test_default_preset_follows_the_data() -> None:
    assert timewin.default_preset(None, 10_000.0) == "Last hour"
    assert timewin.default_preset(9_000.0, 10_000.0) == "Last hour"
    assert timewin.default_preset(1_000.0, 10_000.0) == "Whole run"


def test_config_changes_and_diff() -> None:
    running = {"scheduler": {"max_num_seqs": 64, "queue_limit": 100}, "cache": {"block_size": 32}}
    proposed = {
        "scheduler": {"max_num_seqs": 96, "queue_limit": 100},
        "cache": {"block_size": 32, "enable_prefix_cache": True},
    }
    assert transform.config_changes(running, proposed) == [
        {"setting": "scheduler.max_num_seqs", "running": "64", "proposed": "96"},
        {"setting": "cache.enable_prefix_cache", "running": "(not set)", "proposed": "true"},
    ]
    diff = transform.unified_diff(running, proposed, running_label="engine")
    assert "-  max_num_seqs: 64" in diff and "+  max_num_seqs: 96" in diff
    assert "+  enable_prefix_cache: true" in diff and "queue_limit" not in diff.replace(" queue_limit", "")


def test_metric_comparison() -> None:
    rows = transform.metric_comparison({"ttft": 0.2, "note": "x", "zero": 0}, {"ttft": 0.15, "zero": 1})
    by = {r["metric"]: r for r in rows}
    assert by["ttft"]["change"] == pytest.approx(-0.05) and by["ttft"]["change %"] == pytest.approx(-25.0)
    assert by["note"]["after"] is None and by["note"]["change"] is None
    assert by["zero"]["change %"] is None  # no percentage of zero


def test_alert_history_from_both_body_shapes() -> None:
    n = {"id": 7, "created_at": 1_760_000_100.0, "receiver": "team", "status": "delivered"}
    webhook = {
        "alerts": [
            {
                "status": "resolved",
                "labels": {"alertname": "A", "instance": "e0"},
                "annotations": {"summary": "s"},
                "startsAt": "2025-10-09T08:53:20Z",
                "endsAt": "2025-10-09T08:54:00Z",
            }
        ]
    }
    [row] = transform.alerts_in_notification(n, json.dumps(webhook))
    assert (row["alertname"], row["status"], row["instance"], row["starts_at"]) == ("A", "resolved", "e0", 1.76e9)
    postable = [
        {
            "labels": {"alertname": "B"},
            "annotations": {},
            "startsAt": "2025-10-09T08:53:20Z",
            "endsAt": "2025-10-09T09:53:20Z",
        }
    ]
    [row] = transform.alerts_in_notification(n, json.dumps(postable))
    assert row["status"] == "firing"  # endsAt in the future of the notification: still firing
    assert transform.alerts_in_notification(n, "not json") == []


def test_matcher_text_and_matching() -> None:
    matchers = [
        {"name": "alertname", "value": "A", "isRegex": False, "isEqual": True},
        {"name": "instance", "value": "gpu.*", "isRegex": True, "isEqual": False},
    ]
    assert transform.matcher_text(matchers) == 'alertname="A", instance!~"gpu.*"'
    assert transform.matches(matchers, {"alertname": "A", "instance": "e0"})
    assert not transform.matches(matchers, {"alertname": "A", "instance": "gpu1"})


def test_dashboard_command_line() -> None:
    cmd = dashboard_command(port=8600, host="0.0.0.0", headless=True)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4] == str(app_path())
    assert app_path().is_file()
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=True))
    assert flags["--server.port"] == "8600" and flags["--server.address"] == "0.0.0.0"
    assert flags["--server.headless"] == "true" and flags["--browser.gatherUsageStats"] == "false"
    assert dashboard_url("0.0.0.0", 8600) == "http://127.0.0.1:8600"


def test_kvpilot_dashboard_is_registered() -> None:
    from kvpilot.cli import app

    result = CliRunner().invoke(app, ["dashboard", "--help"])
    assert result.exit_code == 0 and "--db-url" in result.output and "--port" in result.output
