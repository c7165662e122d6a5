"""The diagnosis page through AppTest: the findings collector.queries.diagnose makes, shown with evidence,
cost, knob and study command; "not enough data" where the data cannot tell."""

from __future__ import annotations

from typing import Any

from streamlit.testing.v1 import AppTest

from collector import queries as q
from collector.db import make_engine
from collector.ingest import parse_batch, store_batch
from dashboard.data import diagnosis
from tests.collector import evfactory as ev
from tests.dashboard.conftest import metrics, no_exception, texts
from tests.dashboard.seed import Seed

PAGE = "app_pages/diagnosis.py"
T0 = ev.T0


def _open(open_page, url: str) -> AppTest:
    at = open_page(url)
    return at.switch_page(PAGE).run()


def _req(arrival: float, n: int, queue: float) -> dict[str, Any]:
    e2e = queue + 0.21
    return ev.request(0, ts=arrival + e2e, request_id=f"q{n}", queue_s=queue, prefill_s=0.01, e2e_s=e2e, decode_s=0.2)


def _traps_db(url: str) -> None:
    """e0: two arrivals a second, 12 at seconds 50 and 51 that queue 200 ms; e1: KV usage at 99%."""
    events = []
    for s in range(100):
        if s in (50, 51):
            events += [_req(T0 + s + 0.1 + 0.05 * k, 100 * s + k, 0.2) for k in range(12)]
        else:
            events += [_req(T0 + s + dt, 100 * s + k, 0.005) for k, dt in enumerate((0.1, 0.6))]
    events += [ev.sample(0, instance="e1", ts=T0 + k, kv_usage=0.99, fragmentation=0.02) for k in range(100)]
    engine = make_engine(url)
    raw = ev.body(events)
    store_batch(engine, parse_batch(raw, max_events=100_000), idempotency_key=None, content=raw)
    engine.dispose()


def test_page_shows_each_present_trap_with_evidence_cost_and_study(sqlite_url: str, open_page) -> None:
    _traps_db(sqlite_url)
    at = _open(open_page, sqlite_url)
    no_exception(at)
    assert at.title[0].value == "Diagnosis"
    shown = metrics(at)
    assert shown["Traps present"] == "2" and shown["Not seen"] == "2" and shown["Not enough data"] == "6"
    table = at.dataframe[0].value
    present = table[table["status"] == "present"]
    assert sorted(zip(present["trap"], present["instance"], strict=True)) == [
        ("Bursts the scheduler cannot absorb", "e0"),
        ("The memory wall", "e1"),
    ]
    assert present.set_index("instance").loc["e0", "cost (estimated)"] == "195.0 ms queue per burst arrival"
    warnings = "\n".join(w.value for w in (*at.warning, *at.error))
    assert "2 burst second(s) at up to 12 arrivals/s" in warnings
    assert "KV usage >= 95% in 100% of the samples" in warnings
    codes = [c.value for c in at.code]
    assert any("--knob scheduler.max_num_batched_tokens" in c and "--instance e0" in c for c in codes)
    assert any("--knob scheduler.max_num_seqs" in c and "--instance e1" in c for c in codes)
    # e1 has no requests, so its cold start cannot be judged (e0's run can, and starts no slower than it goes on).
    assert "**e1**: Not enough data: no run of this instance started in the window" in texts(at)
    assert "Rule: a 1-s window with >= 4x the median arrivals per second" in texts(at)
    assert len(at.get("vega_lite_chart")) == 2  # one evidence chart per present finding


def test_page_on_the_dashboard_seed_matches_the_read_package(seeded: Seed, open_page) -> None:
    at = _open(open_page, seeded.url)
    no_exception(at)
    engine = make_engine(seeded.url)
    runs = q.list_runs(engine)
    expected = q.diagnose(
        engine, start=min(r.first_seen_ts for r in runs), end=max(r.last_seen_ts for r in runs) + 1, now=T0
    )
    engine.dispose()
    table = at.dataframe[0].value
    assert len(table) == len(expected) > 0
    for f in expected:
        row = table[(table["trap"] == f.title) & (table["instance"] == f.instance)]
        assert list(row["status"]) == [diagnosis.STATUS_TEXT[f.status]]
    assert metrics(at)["Traps present"] == str(sum(f.present for f in expected))


def test_not_enough_data_is_said_never_fine(seeded: Seed, open_page, monkeypatch) -> None:
    unknown = [
        q.Finding(
            trap, "vllm-a", "no_data", "unknown", "Not enough data: nothing stored", knob="scheduler.max_num_seqs"
        )
        for trap in q.TRAPS
    ]
    monkeypatch.setattr(diagnosis, "findings", lambda f: unknown)
    at = _open(open_page, seeded.url)
    no_exception(at)
    assert metrics(at)["Not enough data"] == "5" and metrics(at)["Not seen"] == "0"
    assert not at.success and texts(at).count("Not enough data: nothing stored") == 5
    assert set(at.dataframe[0].value["cost (estimated)"]) == {"—"}


def test_storage_outage_on_the_diagnosis_page(seeded: Seed, open_page, monkeypatch) -> None:
    from collector.errors import StorageUnavailableError

    def down(f):
        raise StorageUnavailableError("connection refused")

    monkeypatch.setattr(diagnosis, "findings", down)
    at = _open(open_page, seeded.url)
    no_exception(at)
    assert "database is unreachable (connection refused)" in texts(at)


def test_advice_names_the_engines_own_knobs(sqlite_url: str, open_page) -> None:
    """e0 runs vLLM (its cache_config_info was scraped): vLLM's flag and vLLM's study; e1 is kvpilot's engine."""
    from sqlalchemy import insert

    from collector.exposition import labels_json
    from collector.schema import SeriesPoint

    _traps_db(sqlite_url)
    engine = make_engine(sqlite_url)
    with engine.begin() as conn:
        labels = labels_json({"engine": "0", "enable_prefix_caching": "True"})
        conn.execute(
            insert(SeriesPoint.__table__),
            [{"instance": "e0", "name": "kv_cache_config_info", "labels": labels, "ts": T0, "value": 1.0}],
        )
    engine.dispose()
    at = _open(open_page, sqlite_url)
    no_exception(at)
    said = texts(at)
    assert "**Knob (vLLM):** `--max-num-batched-tokens`" in said
    assert "**Knob:** `scheduler.max_num_seqs`" in said  # e1, kvpilot's engine
    codes = [c.value for c in at.code]
    assert any(c.startswith("kvpilot tune vllm study") and "stored:e0" in c for c in codes)
    assert not any("--knob scheduler.max_num_batched_tokens" in c for c in codes)
    assert any("--knob scheduler.max_num_seqs" in c and "--instance e1" in c for c in codes)
