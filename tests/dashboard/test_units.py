"""Time windows, config diffs, alert history parsing and the CLI command line: plain functions."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dashboard import timewin, transform
from kvpilot.cli_dashboard import app_path, dashboard_command, dashboard_url


def test_bucket_width_keeps_charts_under_the_target_and_round() -> None:
    assert timewin.pick_bucket_s(300) == 1.0  # five minutes at the engine's 1 s sample interval
    assert timewin.pick_bucket_s(600) == 2.0
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


def test_default_preset_fits_the_data() -> None:
    now = 100_000.0
    assert timewin.default_preset(None, now) == "Last hour"
    assert timewin.default_preset((now - 7200, now - 5), now) == "Last hour"  # serving for hours: the last one
    assert timewin.default_preset((now - 120, now - 5), now) == "Whole run"  # a two-minute demo: all of it
    assert timewin.default_preset((now - 9000, now - 7000), now) == "Whole run"  # a finished run


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


def test_simulated_data_is_named_by_one_rule() -> None:
    from dashboard.data.catalog import is_simulated

    assert is_simulated("tuner-sim") and is_simulated("tuner-engine")
    for run in (
        "nightly-20261203T150700-4df6-t11-8c4a8a",  # tuner/study.py: <study>-t<n>-<hex6>
        "nightly-20261203T150700-4df6-random-t5-4a4d7f",
        "kv-t3-abcdef-s2",  # one of several seeds
        "nightly-20261203T150700-4df6-confirm-best-s1001-964437",  # tuner/nightly.py confirmation, before
        "nightly-20261204T230256-eb41-confirm-candidate-s1000-p0-1-x2.3",  # a capacity comparison's replay
        "nightly-20261204T230256-eb41-confirm-running-s1001-p1-0s-x0.01562",  # one gone on as a scout
        "bench-capacity-running-x3.67",  # a vLLM tuning's capacity search
        "bench-simcap-x256",
    ):
        assert is_simulated("e0", run), run
    for run in ("demo-20261203-150608", "r1", "shift-t2", "prod-t3-XYZXYZ", "exp-x2", "prod-s1-x3"):
        assert not is_simulated("demo-engine", run), run


def test_rule_thresholds_are_what_a_chart_draws() -> None:
    from alerts.rules import DEMO_RULES, load_rule_files

    found = {
        r.name: [t.condition for t in transform.thresholds(r.name, r.expr)]
        for g in load_rule_files([DEMO_RULES])
        for r in g.rules
    }
    assert found["MemoryPressure"] == ["memory_usage > 90%", "kv_usage > 90%"]
    assert set(found["SchedulerBlocked"]) == {"queue_depth > 100 and …"}  # one condition of an `and`
    from alerts.rules import load_rules_text

    (g,) = load_rules_text("groups: [{name: g, rules: [{alert: Low, expr: '0.5 > utilization'}]}]")
    assert [t.condition for t in transform.thresholds("Low", g.rules[0].expr)] == ["utilization < 50%"]


def test_table_cells_read_as_numbers_with_units() -> None:
    from dashboard import tables

    assert [tables.fmt_seconds(v) for v in (0.000_85, 0.0421, 2.3022730387887904, 600.0)] == [
        "850 µs",
        "42.1 ms",
        "2.3 s",
        "10 min",
    ]
    assert tables.fmt_seconds(None) == tables.fmt_seconds(float("nan")) == ""
    assert tables.fmt_number(1208.4, "tok/s") == "1,208 tok/s" and tables.fmt_number(7.48) == "7.48"
    assert tables.fmt_number(0.10169) == "0.102" and tables.fmt_number(13.24) == "13.2"
    assert tables.fmt_number(150.0) == "150" and tables.fmt_text(0.65) == "0.65" and tables.fmt_text(None) == ""


def test_time_axes_read_24_hour_utc() -> None:
    import pandas as pd

    from dashboard import charts

    minutes = pd.Series(pd.to_datetime([1_800_000_000, 1_800_000_090], unit="s", utc=True))
    week = pd.Series(pd.to_datetime([1_800_000_000, 1_800_600_000], unit="s", utc=True))
    assert charts.time_format(minutes) == "%H:%M:%S"
    assert charts.time_format(week) == "%m-%d %H:%M"
    df = pd.DataFrame({"time": minutes, "v": [1.0, 2.0], "i": ["a", "a"]})
    spec = charts.lines(df, y="v", color="i", title="t", y_title="v").to_dict()
    assert spec["encoding"]["x"]["axis"]["format"] == "%H:%M:%S" and spec["encoding"]["x"]["scale"]["type"] == "utc"
    assert spec["mark"]["interpolate"] == "step-after"


def test_lines_break_where_there_is_no_data() -> None:
    import pandas as pd

    from dashboard import charts

    # line a: every second, then nothing for 20 s; line b (dashed series x) every 5 s without a gap
    a = [(t, float(t)) for t in (*range(0, 6), *range(26, 30))]
    b = [(t, 1.0) for t in range(0, 30, 5)]
    rows = [("a", "x", t, v) for t, v in a] + [("b", "x", t, v) for t, v in b] + [("a", "y", 0, 1.0)]
    df = pd.DataFrame(rows, columns=["i", "s", "ts", "v"])
    df["time"] = pd.to_datetime(df["ts"], unit="s", utc=True)
    out = charts.break_gaps(df, y="v", by=["i", "s"])
    breaks = out[out["v"].isna()]
    assert len(breaks) == 1 and breaks.iloc[0]["i"] == "a"  # b's 5-s spacing is its usual one, not a gap
    # the break is one usual spacing after the last point before the gap: that bucket's end
    assert breaks.iloc[0]["time"] == pd.Timestamp(6, unit="s", tz="UTC")
    spec = charts.lines(df, y="v", color="i", dash="s", title="t", y_title="v").to_dict()
    values = next(iter(spec["datasets"].values()))
    assert sum(v["v"] is None for v in values) == 1  # the chart's data carries the break as null
    assert charts.break_gaps(df.iloc[:0], y="v", by=["i"]).empty


def test_a_capacity_confirmation_reads_as_its_verdict_and_its_capacities() -> None:
    """Every engine's proposal records the capacity comparison (`Comparison.as_dict`) and each side's mean
    held-out capacity: the page says the verdict with its interval and compares the capacities."""
    from tuner.compare import Comparison, interval

    c = Comparison("running", "candidate", 0.03, [1000, 1001], verdict="proposal")
    c.pairs = [
        {"seed": 1000, "running": [10.0, 10.4], "candidate": [12.0, 12.2], "log_ratio": 0.17, "replays": 8},
        {"seed": 1001, "running": [9.0, 9.2], "candidate": [11.0, 10.6], "log_ratio": 0.18, "replays": 8},
    ]
    c.interval = interval([0.17, 0.18])
    record = json.loads(json.dumps(c.as_dict()))  # as the proposals row stores it
    text = transform.confirmation_verdict({"confirmation": record})
    assert text is not None and text.startswith("Confirmation holds: serves +19.1% traffic at the same SLOs")
    assert "90% interval" in text and "2 ABBA pairs" in text
    c.verdict = "no gain"
    assert transform.confirmation_verdict({"confirmation": c.as_dict()}).startswith("Confirmation does not hold")
    # the first vLLM proposals recorded the gain and its bounds only (always a proposal)
    old = transform.confirmation_verdict({"confirmation": {"gain": 0.1, "gain_low": 0.02, "gain_high": 0.2}})
    assert old == "Confirmation holds: +10.0% capacity (lower bound +2.0%)."
    sections = transform.proposal_measurements(
        {"heldout_capacity_rps": record["running_capacity_rps"]},
        {"heldout_capacity_rps": record["candidate_capacity_rps"], "confirmation": record},
    )
    title, rows = sections[0]
    assert title.startswith("SLO capacity on held-out seeds") and rows[0]["metric"] == "capacity_rps"
    assert rows[0]["before"] == pytest.approx(9.65) and rows[0]["after"] == pytest.approx(11.45)
    # the pipeline's baseline phase: the running config's own capacity and the headroom it leaves
    from tuner.capacity import Capacity

    for multiplier, room in ((2.59, "159% headroom"), (0.84, "the traffic is past it")):
        before = {"capacity": Capacity(rate_rps=15.45, multiplier=multiplier, upper=multiplier * 1.1).summary()}
        line = transform.running_capacity_line(json.loads(json.dumps(before)))
        assert line is not None and f"{multiplier:.3g}x the traffic's 15.4 req/s ({room})" in line, line
    assert transform.running_capacity_line({"heldout_capacity_rps": 9.65}) is None
