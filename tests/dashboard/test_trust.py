"""What an on-call engineer reads at a glance must be true: real traffic only, rates over the time with traffic,
peaks against the rule's line, 24-hour UTC, readable tables, the rules and their state, stable page URLs.

Runs on the seed plus the tuner's simulated runs and a KV spike (tests/dashboard/seed_sim.py); the seed has
scraped-only instances too (seed_scraped.py).
"""

from __future__ import annotations

import json

import pytest

from alerts.rules import DEMO_RULES
from dashboard import ui
from dashboard.data import serving
from tests.dashboard.conftest import APP, PAGE_FILES, metrics, no_exception, table_with, texts
from tests.dashboard.seed import Seed
from tests.dashboard.seed_sim import OOM_RETRIES, SIM, SIM_RUNS, TRIAL_ONLY, TRIAL_ONLY_RUN

SCRAPED_ONLY = ["vllm-a", "dcgm-node1"]


def _specs(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]


def _chart_texts(at) -> str:
    """Every value in the charts' datasets, joined (a threshold's label travels as data, not in the spec)."""
    from streamlit.dataframe_util import convert_arrow_bytes_to_pandas_df

    frames = [
        convert_arrow_bytes_to_pandas_df(d.data.data) for c in at.get("vega_lite_chart") for d in c.proto.datasets
    ]
    return "\n".join(str(v) for df in frames for col in df.columns for v in df[col].tolist())


def _walk(node):
    """Every dict inside a Vega-Lite spec (layers, concatenations, encodings)."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


@pytest.mark.parametrize("page", list(PAGE_FILES))
@pytest.mark.parametrize("scope", ["all", "scraped only"])
def test_every_page_reads_true_on_mixed_data(page: str, scope: str, mixed: Seed, open_page) -> None:
    at = open_page(mixed.url, page)
    if scope == "scraped only":
        at.multiselect(key="f_instances").set_value(SCRAPED_ONLY).run()
    no_exception(at)
    for frame in at.dataframe:
        value = frame.value
        if "instance" in value.columns:
            assert not {SIM, TRIAL_ONLY} & set(value["instance"]), (page, list(value.columns))
        assert frame.proto.placeholder == ""  # a missing value is an empty cell, not "None"
        for name, config in json.loads(frame.proto.columns).items():
            if name == "_index":
                continue
            assert config.get("label") and "_" not in config["label"], (page, name, config)
    for spec in _specs(at):
        for node in _walk(spec):
            assert node.get("interpolate") in (None, "step-after"), (page, node)  # no smoothed curve
            if node.get("type") == "temporal" and "axis" in node:
                assert node["axis"]["format"] in ("%H:%M:%S", "%m-%d %H:%M"), (page, node)  # 24-hour, UTC
                assert node["scale"]["type"] == "utc"
    assert "All times are UTC" in texts(at)


def test_simulated_and_trial_runs_stay_out_unless_asked_for(mixed: Seed, open_page) -> None:
    at = open_page(mixed.url)
    f = at.session_state[ui.FILTERS_KEY]
    assert f.hidden == (TRIAL_ONLY, SIM)  # tuner-sim by name, bench-1 because its only run is a trial run
    assert metrics(at)["Requests"] == f"{len(mixed.requests):,}"  # the seed's real requests only
    assert not [o for o in at.multiselect(key="f_instances").options if SIM in o or TRIAL_ONLY in o]
    assert not [o for o in at.selectbox(key="f_run").options if any(r in o for r in (*SIM_RUNS, TRIAL_ONLY_RUN))]
    assert "tuner-sim: memory at 100%" not in texts(at)  # the simulator's alert is not a page
    utilization = serving.gauges(f, ("utilization",))
    assert SIM not in set(utilization["instance"])

    at.toggle(key="f_sim").set_value(True).run()
    no_exception(at)
    simulated = 3 * 100 + 10
    assert metrics(at)["Requests"] == f"{len(mixed.requests) + simulated:,}"
    assert SIM in table_with(at, "requests")["instance"].tolist()
    assert any(SIM_RUNS[0] in o for o in at.selectbox(key="f_run").options)


def test_alerts_of_simulated_instances_are_left_out(mixed: Seed, open_page) -> None:
    at = open_page(mixed.url, "alerts")
    assert (metrics(at)["Firing"], metrics(at)["Pending"]) == ("1", "1")
    at.toggle(key="f_sim").set_value(True).run()
    assert metrics(at)["Firing"] == "2"


def test_rates_cover_the_time_with_traffic_not_the_window(seeded: Seed, open_page) -> None:
    from datetime import UTC, datetime, timedelta

    at = open_page(seeded.url)
    at.selectbox(key="f_range").set_value("Custom").run()
    first = datetime.fromtimestamp(seeded.requests[0]["ts"], tz=UTC)
    start, end = first - timedelta(hours=1), first + timedelta(hours=1)  # two hours around ten minutes of traffic
    at.date_input(key="f_start_date").set_value(start.date())
    at.time_input(key="f_start_time").set_value(start.time().replace(second=0, microsecond=0))
    at.date_input(key="f_end_date").set_value(end.date())
    at.time_input(key="f_end_time").set_value(end.time().replace(second=0, microsecond=0)).run()
    no_exception(at)
    finished = [r["ts"] for r in seeded.finished()]
    traffic_s = max(finished) - min(finished)  # 590 s; one 30-s chart bucket of slack at either end
    rate = float(metrics(at)["Requests/s"])
    assert len(seeded.requests) / (traffic_s + 60) <= rate <= len(seeded.requests) / traffic_s
    assert rate > 5 * len(seeded.requests) / 7200  # not averaged over the two-hour window
    assert "with traffic" in texts(at)
    e0 = table_with(at, "req/s").set_index("instance").loc["e0", "req/s"]
    assert e0 == pytest.approx(sum(r["instance"] == "e0" for r in seeded.requests) / 600, rel=0.1)


def test_a_kv_spike_shows_as_100_percent_against_the_rule(mixed: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_RULE_FILES", str(DEMO_RULES))
    at = open_page(mixed.url, "kv_memory")
    no_exception(at)
    assert metrics(at)["Hot tier, highest sample"] == "100.0%"
    assert "over MemoryPressure's 90%" in texts(at)
    f = at.session_state[ui.FILTERS_KEY]
    averaged = serving.gauges(f, ("kv_usage",))
    assert averaged[averaged["instance"] == "e0"]["value"].max() < 0.9  # what the page used to draw
    peaks = serving.gauges(f, ("kv_usage",), agg="max")
    assert peaks[peaks["instance"] == "e0"]["value"].max() == 1.0
    assert "MemoryPressure fires at kv_usage > 90%" in _chart_texts(at)

    at = open_page(mixed.url)  # the overview's KV chart draws the same line
    assert "MemoryPressure fires at kv_usage > 90%" in _chart_texts(at)


def test_oom_counts_retried_allocations_not_failed_requests(mixed: Seed, open_page) -> None:
    at = open_page(mixed.url, "kv_memory")
    shown = metrics(at)
    assert shown["Alloc retries"] == str(OOM_RETRIES)
    assert shown["Requests failed"] == str(sum(r["status"] == "failed" for r in mixed.requests))
    assert "oom" not in shown  # the engine's op name is not a headline
    assert f"**Alloc retries** ({OOM_RETRIES}): attempts to grow a request's KV blocks" in texts(at)


def test_alerts_page_lists_rules_with_thresholds_and_resolved_alerts_apart(mixed: Seed, open_page, monkeypatch) -> None:
    from alerts.rules import BUILTIN_RULES

    monkeypatch.setenv("KVPILOT_DASHBOARD_RULE_FILES", str(BUILTIN_RULES))
    at = open_page(mixed.url, "alerts")
    no_exception(at)
    active = at.dataframe[0].value
    assert list(active["state"]) == ["firing", "pending"]  # the resolved one is not "firing and pending"
    resolved = table_with(at, "resolved_at", "alertname")
    assert list(resolved["alertname"]) == ["SwapThrashing"]
    rules = table_with(at, "rule", "fires when").set_index("rule")
    assert rules.loc["MemoryPressure", "fires when"] == "memory_usage > 90%"
    assert rules.loc["SwapThrashing", "fires when"] == "swap_rate > 100"
    assert rules.loc["SwapThrashing", "state"] == "1 resolved" and rules.loc["MemoryPressure", "state"] == "inactive"
    assert rules.loc["SwapThrashing", "for"] == "1m"
    assert "Alerts of rules not in these files: HighTTFT, KvCacheNearlyFull." in texts(at)
    assert metrics(at)["Rules"] == str(len(rules))


def test_a_broken_rule_file_is_named_not_raised(seeded: Seed, open_page, monkeypatch, tmp_path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("groups: [{name: g, rules: [{alert: X, expr: 'kv_usage >'}]}]")
    monkeypatch.setenv("KVPILOT_DASHBOARD_RULE_FILES", str(bad))
    at = open_page(seeded.url, "alerts")
    no_exception(at)
    assert "the rule files do not load" in texts(at) and "bad.yml" in texts(at)


def test_every_page_has_a_stable_url(seeded: Seed, open_page) -> None:
    """The paths st.navigation serves (tests/dashboard/test_browser.py opens each, `/` and `/overview` too)."""
    text = APP.read_text()
    for path in ("overview", "latency", "kv-memory", "alerts", "tuning", "targets"):
        assert f'url_path="{path}"' in text
    at = open_page(seeded.url, "overview")  # app_pages/overview.py: opened at "/" and at "/overview"
    no_exception(at)
    assert metrics(at)["Requests"] == f"{len(seeded.requests):,}"


def test_a_link_to_simulated_data_says_so_in_the_url(mixed: Seed, open_page, monkeypatch) -> None:
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("KVPILOT_DB_URL", mixed.url)
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update({"instance": SIM, "sim": "1", "range": "Whole run"})
    at.run()
    no_exception(at)
    assert at.toggle(key="f_sim").value and at.multiselect(key="f_instances").value == [SIM]
    assert metrics(at)["Requests"] == "300"
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params.update({"instance": SIM, "range": "Whole run"})  # without sim=1: not shown
    at.run()
    assert at.multiselect(key="f_instances").value == []
    assert metrics(at)["Requests"] == f"{len(mixed.requests):,}"
