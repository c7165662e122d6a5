"""Every page through AppTest on the seeded database: no exception, and the numbers shown are the seed's."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
from sqlalchemy import inspect, select

from collector.db import make_engine
from collector.schema import AlertSilence, Proposal
from dashboard import ui
from plumbing.percentile import nearest_rank
from tests.dashboard.conftest import PAGE_FILES, PASSWORD, metrics, no_exception, sign_in, table_with, texts
from tests.dashboard.seed import OPS, TRIALS, Seed, pareto_trials, seed_database


def _ttfts(seed: Seed, instance: str | None = None) -> list[float]:
    return [r["ttft_s"] for r in seed.finished(instance)]


def test_overview_headline_and_per_instance_numbers(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url)
    no_exception(at)
    shown = metrics(at)
    assert shown["Requests"] == f"{len(seeded.requests):,}"
    assert shown["TTFT p99"] == ui.fmt_s(nearest_rank(_ttfts(seeded), 0.99))
    tpots = [r["decode_s"] / (r["output_tokens"] - 1) for r in seeded.finished()]
    assert shown["TPOT p99"] == ui.fmt_s(nearest_rank(tpots, 0.99))
    assert shown["Not finished"] == str(sum(r["status"] != "finished" for r in seeded.requests))
    assert "KvCacheNearlyFull" in texts(at)  # the firing alert, by name

    traffic = table_with(at, "requests", "TTFT p99 (s)").set_index("instance")
    now = table_with(at, "KV usage", "utilization").set_index("instance")
    for inst in ("e0", "e1"):
        assert traffic.loc[inst, "requests"] == sum(r["instance"] == inst for r in seeded.requests)
        assert traffic.loc[inst, "TTFT p99 (s)"] == pytest.approx(nearest_rank(_ttfts(seeded, inst), 0.99))
        newest = max((s for s in seeded.samples if s["instance"] == inst), key=lambda s: s["ts"])
        assert now.loc[inst, "KV usage"] == pytest.approx(newest["kv_usage"])
        assert now.loc[inst, "utilization"] == pytest.approx(newest["utilization"])


def test_instance_and_run_filters_narrow_every_number(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url)
    at.multiselect(key="f_instances").set_value(["e1"]).run()
    no_exception(at)
    assert metrics(at)["Requests"] == str(sum(r["instance"] == "e1" for r in seeded.requests))
    assert metrics(at)["TTFT p99"] == ui.fmt_s(nearest_rank(_ttfts(seeded, "e1"), 0.99))
    assert list(table_with(at, "requests")["instance"]) == ["e1"]
    # The firing alert is on e0: filtered to e1 the page says nothing fires (one pending on e1).
    assert "No alerts firing (1 pending)" in texts(at)
    assert at.selectbox(key="f_run").options == ["All runs", "r1 · e0, e1 · to 10-09 09:03"]


def test_custom_time_range_limits_the_window(seeded: Seed, open_page) -> None:
    from datetime import UTC, datetime, timedelta

    at = open_page(seeded.url)
    at.selectbox(key="f_range").set_value("Custom").run()
    # Minutes (the time inputs step by a minute): 08:54 to 08:56 UTC, inside the seeded run.
    start = datetime.fromtimestamp(seeded.requests[0]["ts"] + 60, tz=UTC).replace(second=0)
    end = start + timedelta(minutes=2)
    at.date_input(key="f_start_date").set_value(start.date())
    at.time_input(key="f_start_time").set_value(start.time())
    at.date_input(key="f_end_date").set_value(end.date())
    at.time_input(key="f_end_time").set_value(end.time()).run()
    no_exception(at)
    lo, hi = start.timestamp(), end.timestamp()
    assert 0 < sum(lo <= r["ts"] < hi for r in seeded.requests) < len(seeded.requests)
    assert metrics(at)["Requests"] == str(sum(lo <= r["ts"] < hi for r in seeded.requests))


def test_relative_range_on_old_data_says_what_to_do(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url)
    assert at.selectbox(key="f_range").value == "Whole run"  # data older than an hour: the run's span
    at.selectbox(key="f_range").set_value("Last hour").run()
    no_exception(at)
    assert metrics(at)["Requests"] == "0"
    assert "No engine data" in texts(at) and "widen the time range" in texts(at)


def test_latency_page_percentiles_stages_and_slowest(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "latency")
    no_exception(at)
    finished = seeded.finished()
    shown = metrics(at)
    assert shown["TTFT p99"] == ui.fmt_s(nearest_rank(_ttfts(seeded), 0.99))
    assert shown["End to end p99"] == ui.fmt_s(nearest_rank([r["e2e_s"] for r in finished], 0.99))
    assert shown["Finished requests"] == str(len(finished))
    summary = at.dataframe[0].value.set_index("stage")
    for stage, key in (("Queue", "queue_s"), ("Prefill", "prefill_s"), ("Decode", "decode_s"), ("End to end", "e2e_s")):
        values = [r[key] for r in finished]
        assert summary.loc[stage, "requests"] == len(values)
        assert summary.loc[stage, "mean (s)"] == pytest.approx(statistics.fmean(values))
        for q in (0.5, 0.9, 0.95, 0.99):
            assert summary.loc[stage, f"p{round(q * 100)} (s)"] == pytest.approx(nearest_rank(values, q))
    swap_seconds = [r.get("swap_s", 0.0) for r in finished]
    assert sum(s > 0 for s in swap_seconds) > 0
    assert summary.loc["Swap", "requests"] == len(finished)
    assert summary.loc["Swap", "mean (s)"] == pytest.approx(statistics.fmean(swap_seconds))
    assert summary.loc["Swap", "max (s)"] == pytest.approx(max(swap_seconds))
    swaps = sum(r.get("swaps", 0) for r in finished)
    assert f"swapped {swaps:,} times, for a mean of {ui.fmt_s(statistics.fmean(swap_seconds))} swapped out" in texts(at)
    assert "swap: time swapped out to the host tier" in texts(at)
    slowest = at.dataframe[1].value
    assert slowest.iloc[0]["request_id"] == "e0-slow"
    assert slowest.iloc[0]["End to end (s)"] == pytest.approx(3.71)
    assert list(slowest["End to end (s)"]) == sorted(slowest["End to end (s)"], reverse=True)

    at.segmented_control(key="lat_metric").set_value("tpot").run()
    at.selectbox(key="slow_metric").set_value("ttft").run()
    no_exception(at)
    assert at.dataframe[1].value.iloc[0]["TTFT (s)"] == pytest.approx(1.71)


def test_kv_memory_page_usage_and_allocation_trace(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "kv_memory")
    no_exception(at)
    shown = metrics(at)
    assert shown["Hot tier, highest sample"] == ui.fmt_pct(max(s["kv_usage"] for s in seeded.samples))
    # One sample per instance per bucket: the mean of the bucket averages is the mean of the samples.
    mean = statistics.fmean(s["kv_usage"] for s in seeded.samples)
    assert f"mean {ui.fmt_pct(mean)}" in texts(at)
    assert shown["External fragmentation (mean)"] == ui.fmt_pct(0.1)
    labels = {"alloc": "Allocations", "free": "Frees", "swap_out": "Swapped out", "swap_in": "Swapped in"}
    for op in set(OPS):
        assert shown[labels.get(op, "Evicted")] == f"{sum(a['op'] == op for a in seeded.allocs):,}"
    assert shown["Requests failed"] == str(sum(r["status"] == "failed" for r in seeded.requests))
    assert f"all {len(seeded.allocs)} events in the window" in texts(at)
    trace = table_with(at, "usage_after")
    assert len(trace) == len(seeded.allocs)
    assert list(trace["op"][:3]) == list(OPS[:3])  # time order


def test_alerts_page_state_deliveries_and_silences(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "alerts")
    no_exception(at)
    shown = metrics(at)
    assert (shown["Firing"], shown["Pending"], shown["Active silences"]) == ("1", "1", "1")
    states = at.dataframe[0].value
    assert list(states["alertname"]) == ["KvCacheNearlyFull", "HighTTFT"]  # firing first
    assert list(states["silenced"]) == [False, True]  # the seeded silence matches HighTTFT
    history = table_with(at, "notified_at", "receiver")
    assert set(history["receiver"]) == {"team", "pager"} and set(history["alertname"]) == {"KvCacheNearlyFull"}
    deliveries = table_with(at, "attempts", "last_error").set_index("id")
    assert deliveries.loc[2, "status"] == "failed" and deliveries.loc[2, "attempts"] == 3
    assert deliveries.loc[2, "last_error"] == "HTTP 500 from receiver"
    attempts = table_with(at, "outcome")  # of the newest delivery, #2
    assert list(attempts["outcome"]) == ["retry", "retry", "failed"]


def test_creating_and_expiring_a_silence_writes_through_alerts(seeded: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    at = sign_in(open_page(seeded.url, "alerts"), "carol")
    at.text_area(key="silence_matchers").set_value('alertname=KvCacheNearlyFull\ninstance=~"e.*"')
    at.text_input(key="silence_comment").set_value("resizing the cache")
    next(b for b in at.button if b.label == "Create silence").click().run()
    no_exception(at)
    assert metrics(at)["Active silences"] == "2"
    assert list(at.dataframe[0].value["silenced"]) == [True, True]
    engine = make_engine(seeded.url)
    with engine.connect() as conn:
        created = conn.execute(select(AlertSilence).where(AlertSilence.comment == "resizing the cache")).one()
    assert [m["name"] for m in created.matchers] == ["alertname", "instance"]
    assert created.created_by == "carol"  # the signed-in user, not a name typed into the form
    assert created.ends_at - created.starts_at == pytest.approx(2 * 3600)

    at.selectbox(key="silence_expire_pick").set_value(created.id)
    at.button(key="silence_expire").click().run()
    no_exception(at)
    assert metrics(at)["Active silences"] == "1"
    with engine.connect() as conn:
        row = conn.execute(select(AlertSilence).where(AlertSilence.id == created.id)).one()
    engine.dispose()
    assert row.ends_at <= row.updated_at  # expired now


def test_bad_matcher_is_refused_with_the_reason(seeded: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    at = sign_in(open_page(seeded.url, "alerts"))
    at.text_area(key="silence_matchers").set_value("not a matcher")
    next(b for b in at.button if b.label == "Create silence").click().run()
    no_exception(at)
    assert "Silence not created: bad matcher 'not a matcher'" in texts(at)
    assert metrics(at)["Active silences"] == "1"


def test_tuning_page_study_pareto_and_proposal_diff(seeded: Seed, open_page) -> None:
    pytest.importorskip("optuna")
    at = open_page(seeded.url, "tuning")
    no_exception(at)
    shown = metrics(at)
    assert shown["Trials"] == "8" and shown["Complete"] == "8"
    assert shown["Pareto-optimal"] == str(len(pareto_trials()))
    trials = table_with(at, "trial", "ttft_p99_s")
    assert list(trials["ttft_p99_s"]) == pytest.approx([t[2] for t in TRIALS])
    # The newest proposal (#2, pending) against the last applied one (#1).
    assert "Compared with the last applied proposal #1." in texts(at)
    changes = next(d.value for d in at.dataframe if "setting" in d.value.columns)
    assert dict(zip(changes["setting"], zip(changes["running"], changes["proposed"], strict=True), strict=True)) == {
        "scheduler.max_num_seqs": ("64", "96"),
        "cache.block_size": ("32", "16"),
    }
    tables = [d.value.set_index("metric") for d in at.dataframe if "change %" in d.value.columns]
    confirmation, trial, params = tables  # in that order: the re-runs first, the study's trial, the parameters
    assert confirmation.loc["goodput_tps", "before"] == pytest.approx(1000.0)  # mean of the baseline runs
    assert confirmation.loc["goodput_tps", "change %"] == pytest.approx(20.0)
    assert trial.loc["throughput_tok_s", "change %"] == pytest.approx(25.0)
    assert trial.loc["ttft_p99_s", "change"] == pytest.approx(-0.03)
    assert params.loc["max_num_seqs", "after"] == 96
    assert "Confirmation holds: +20.0% goodput (needed +5.0%)." in texts(at)


def test_accepting_then_rejecting_a_proposal_goes_through_the_tuner(seeded: Seed, open_page, monkeypatch) -> None:
    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    at = sign_in(open_page(seeded.url, "tuning"))
    at.button(key="accept_2").click().run()
    no_exception(at)
    assert _status(seeded.url, 2) == "accepted"
    assert not [b for b in at.button if b.key == "accept_2"]  # accepted: only Reject is left
    at.button(key="reject_2").click().run()
    no_exception(at)
    assert _status(seeded.url, 2) == "rejected"
    assert "This proposal is rejected: that is final." in texts(at)
    assert not [b for b in at.button if b.key in ("accept_2", "reject_2")]


def _status(url: str, proposal_id: int) -> str:
    engine = make_engine(url)
    with engine.connect() as conn:
        status = conn.execute(select(Proposal.status).where(Proposal.id == proposal_id)).scalar_one()
    engine.dispose()
    return status


def test_a_proposal_decided_elsewhere_is_not_overwritten(seeded: Seed, open_page, monkeypatch) -> None:
    from dashboard.data import tuning
    from tuner.proposals import set_status

    monkeypatch.setenv("KVPILOT_DASHBOARD_PASSWORD", PASSWORD)
    at = sign_in(open_page(seeded.url, "tuning"))
    # Another reviewer (`kvpilot tune reject`, another dashboard) decides after this page loaded: the cached
    # page still offers Accept, and the compare-and-set refuses it.
    engine = make_engine(seeded.url)
    set_status(engine, 2, "rejected")
    engine.dispose()
    at.button(key="accept_2").click().run()
    no_exception(at)
    assert _status(seeded.url, 2) == "rejected"
    assert "Proposal #2 not changed: proposal 2 is rejected; it cannot become accepted" in texts(at)
    with pytest.raises(ValueError, match="only accepts or rejects"):
        tuning.set_proposal_status(seeded.url, 1, "applied", user="alice")


def test_targets_page_health(seeded: Seed, open_page) -> None:
    # The seed is made once per session: minutes later its healthy targets' last scrapes read as stale
    # (> 3 intervals old). Scrape them "now", as a running scraper would have.
    from sqlalchemy import update

    from collector.db import make_engine
    from collector.schema import ScrapeTarget

    t = ScrapeTarget.__table__
    db = make_engine(seeded.url)
    with db.begin() as conn:
        conn.execute(update(t).where(t.c.up.is_(True)).values(last_scrape_at=time.time()))
    db.dispose()
    at = open_page(seeded.url, "targets")
    no_exception(at)
    shown = metrics(at)
    assert (shown["Targets"], shown["Up"], shown["Down"]) == ("3", "2", "1")
    assert "is down: connection refused" in texts(at)
    table = table_with(at, "health").set_index("instance")
    assert table.loc["gpu-b", "health"] == "down" and table.loc["vllm-a", "health"] == "up"
    assert table.loc["dcgm-node1", "labels"] == "node=node-1" and table.loc["dcgm-node1", "sample_limit"] == 5000


@pytest.mark.parametrize("page", list(PAGE_FILES))
def test_every_page_on_an_empty_database_explains_what_to_do(page: str, sqlite_url: str, open_page) -> None:
    at = open_page(sqlite_url, page)
    no_exception(at)
    said = texts(at)
    assert "No " in said, said  # each empty state starts "No <what>"
    assert any(hint in said for hint in ("kvpilot", "Start", "run", "POST")), said


def test_missing_database_file_says_how_to_get_one(tmp_path, open_page) -> None:
    at = open_page(f"sqlite:///{tmp_path}/absent.db")
    no_exception(at)
    assert "No database at" in texts(at) and "kvpilot collector serve" in texts(at)
    assert not (tmp_path / "absent.db").exists()  # the dashboard only reads: it created nothing


def test_unmigrated_database_says_run_upgrade(tmp_path, open_page) -> None:
    path = tmp_path / "empty.db"
    engine = make_engine(f"sqlite:///{path}")
    engine.connect().close()
    engine.dispose()
    at = open_page(f"sqlite:///{path}")
    no_exception(at)
    assert "kvpilot db upgrade" in texts(at)


def test_storage_outage_shows_an_error_not_a_traceback(seeded: Seed, open_page, monkeypatch) -> None:
    from collector.errors import StorageUnavailableError
    from dashboard.data import latency

    def down(*_a, **_k):
        raise StorageUnavailableError("connection refused")

    monkeypatch.setattr(latency, "summary", down)
    at = open_page(seeded.url, "latency")
    no_exception(at)
    assert "database is unreachable (connection refused)" in texts(at)


def test_tuning_page_without_optuna_still_lists_proposals(seeded: Seed, open_page, monkeypatch) -> None:
    from dashboard.data import tuning

    def missing():
        raise tuning.DataUnavailable("Optuna is not installed here")

    monkeypatch.setattr(tuning, "_optuna", missing)
    at = open_page(seeded.url, "tuning")
    no_exception(at)
    assert "Optuna is not installed here" in texts(at)
    assert "Proposal #2 — pending" in texts(at)


def test_tuning_page_without_studies_says_how_to_start_one(sqlite_url: str, open_page) -> None:
    seed_database(sqlite_url, with_study=False)
    at = open_page(sqlite_url, "tuning")
    no_exception(at)
    assert "No Optuna studies for this database yet" in texts(at)
    from dashboard.data import tuning

    storage = Path(tuning.study_storage_url(sqlite_url).removeprefix("sqlite:///"))
    assert not storage.exists()  # the dashboard only reads: it created no study storage
    engine = make_engine(sqlite_url)
    assert not inspect(engine).has_table("studies")
    engine.dispose()
    assert "Proposal #2 — pending" in texts(at)  # proposals do not need a study


def test_refresh_now_shows_new_data_and_auto_refresh_offers_intervals(seeded: Seed, open_page) -> None:
    from collector.ingest import parse_batch, store_batch
    from tests.collector import evfactory as ev

    at = open_page(seeded.url)
    before = int(metrics(at)["Requests"])
    engine = make_engine(seeded.url)
    body = ev.body([ev.request(0, ts=seeded.requests[0]["ts"] + 100.5, request_id="late")])
    store_batch(engine, parse_batch(body, max_events=10), idempotency_key=None, content=body)
    engine.dispose()
    at.run()
    assert int(metrics(at)["Requests"]) == before  # still cached (TTL)
    at.button(key="f_refresh_now").click().run()
    assert int(metrics(at)["Requests"]) == before + 1

    at.toggle(key="f_refresh").set_value(True).run()
    no_exception(at)
    assert at.selectbox(key="f_refresh_s").options == ["10 s", "30 s", "60 s", "300 s"]


@pytest.mark.postgres
def test_every_page_shows_the_same_numbers_on_postgresql(pg_url: str, sqlite_url: str, open_page) -> None:
    """One dashboard, two backends: each page's headline numbers agree (Optuna left out: the schema is shared)."""
    seed_database(pg_url, with_study=False)
    seed_database(sqlite_url, with_study=False)
    for page in PAGE_FILES:
        on_pg = open_page(pg_url, page)
        no_exception(on_pg)
        on_sqlite = open_page(sqlite_url, page)
        shown = metrics(on_pg)
        assert shown or page == "tuning", page
        assert ("Proposal #2 — pending" in texts(on_pg)) == (page == "tuning")
        volatile = {"Up", "Stale / never scraped"}  # relative to now: the two seeds ran a moment apart
        assert {k: v for k, v in shown.items() if k not in volatile} == {
            k: v for k, v in metrics(on_sqlite).items() if k not in volatile
        }, page


def test_run_filter_keeps_gauges_to_that_run(seeded: Seed, open_page) -> None:
    from collector.ingest import parse_batch, store_batch
    from dashboard.data import serving
    from tests.collector import evfactory as ev

    # A second run on e0 with a full KV cache; r1's charts must not show it.
    engine = make_engine(seeded.url)
    body = ev.body([ev.sample(0, ts=seeded.samples[0]["ts"] + k, run_id="r2", kv_usage=1.0) for k in range(5)])
    store_batch(engine, parse_batch(body, max_events=10), idempotency_key=None, content=body)
    engine.dispose()
    at = open_page(seeded.url)
    at.selectbox(key="f_run").set_value("r1").run()
    no_exception(at)
    f = at.session_state[ui.FILTERS_KEY]
    assert f.run_id == "r1"
    kv = serving.gauges(f, ("kv_usage",))
    kv = kv[kv["instance"].isin(["e0", "e1"])]  # scraped series carry no run: shown whole
    assert kv["value"].max() == pytest.approx(max(s["kv_usage"] for s in seeded.samples))
    every_run = serving.gauges(f.__class__(**{**f.__dict__, "run_id": None}), ("kv_usage",))
    assert every_run[every_run["instance"] == "e0"]["value"].max() == 1.0


def test_alerts_page_follows_the_instance_filter(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url, "alerts")
    at.multiselect(key="f_instances").set_value(["e1"]).run()
    no_exception(at)
    assert (metrics(at)["Firing"], metrics(at)["Pending"]) == ("0", "1")
    assert list(at.dataframe[0].value["alertname"]) == ["HighTTFT"]  # firing and pending


def test_proposal_diff_against_a_configured_engine(seeded: Seed, open_page, monkeypatch) -> None:
    from dashboard.data import tuning

    seen = []

    def fake_running_config(name: str) -> dict:
        seen.append(name)
        return {"scheduler": {"max_num_seqs": 80, "max_num_batched_tokens": 4096}, "cache": {"block_size": 16}}

    monkeypatch.setattr(tuning, "running_config", fake_running_config)
    monkeypatch.setenv("KVPILOT_DASHBOARD_ENGINES", "h200-a=http://10.0.0.9:8000,h200-b=http://10.0.0.10:8000")
    at = open_page(seeded.url, "tuning")
    no_exception(at)
    assert at.selectbox(key="engine_pick").options == [
        "h200-a · http://10.0.0.9:8000",
        "h200-b · http://10.0.0.10:8000",
    ]
    assert seen == ["h200-a"]
    assert "Compared with the running engine h200-a." in texts(at)
    changes = table_with(at, "setting")
    assert list(changes["setting"]) == ["scheduler.max_num_seqs"]  # block_size 16 already runs
    at.selectbox(key="engine_pick").set_value("h200-b").run()
    assert seen[-1] == "h200-b"


def test_filters_round_trip_through_the_url(seeded: Seed, open_page, monkeypatch) -> None:
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.conftest import APP

    monkeypatch.setenv("KVPILOT_DB_URL", seeded.url)
    at = AppTest.from_file(str(APP), default_timeout=30)
    lo = seeded.requests[0]["ts"] + 60
    at.query_params.update({"instance": "e1", "range": "Custom", "from": str(int(lo)), "to": str(int(lo) + 120)})
    at.run()
    no_exception(at)
    assert at.multiselect(key="f_instances").value == ["e1"]
    assert at.selectbox(key="f_range").value == "Custom"
    f = at.session_state[ui.FILTERS_KEY]
    assert (f.instances, f.start, f.end) == (("e1",), int(lo), int(lo) + 120)
    at.selectbox(key="f_range").set_value("Whole run").run()
    assert dict(at.query_params) == {"range": "Whole run", "instance": "e1"}


def test_overview_says_how_much_telemetry_was_lost(seeded: Seed, open_page) -> None:
    from collector.ingest import parse_batch, store_batch
    from tests.collector import evfactory as ev

    gap = ev.gap(100, instance="e0", events=3176, first_ts=ev.T0 + 10, last_ts=ev.T0 + 90)
    raw = ev.body([gap, ev.gap(100, instance="e0", kind="sample", reason="unauthorized", events=5)])
    engine = make_engine(seeded.url)
    store_batch(engine, parse_batch(raw, max_events=10), idempotency_key="gaps", content=raw)
    engine.dispose()
    at = open_page(seeded.url)
    no_exception(at)
    (notice,) = [w.value for w in at.warning if "Telemetry lost" in w.value]
    assert "**Telemetry lost: 3,181 events**" in notice
    assert "`e0`: 3,176 request events (spool full)" in notice and "5 sample events (unauthorized)" in notice
    at.multiselect(key="f_instances").set_value(["e1"]).run()
    assert not [w for w in at.warning if "Telemetry lost" in w.value]


def test_overview_without_losses_has_no_loss_notice(seeded: Seed, open_page) -> None:
    at = open_page(seeded.url)
    assert not [w for w in at.warning if "Telemetry lost" in w.value]
