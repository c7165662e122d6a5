"""The scraper against real HTTP into SQLite and PostgreSQL: labelled series, target labels, bounds, health.

Assertions read the raw `series_points` rows: what a series means over time is the read side's to test.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, insert, select

from collector.exposition import Point, labels_json
from collector.netpolicy import LOOPBACK_NETS, AddressPolicy
from collector.schema import Instance, ScrapeTarget, SeriesPoint
from collector.scraper import (
    MAX_LABEL_VALUE_CHARS,
    ScrapeMetrics,
    Scraper,
    TargetLabelsError,
    bound_series,
    validate_sample_limit,
    validate_target_labels,
    with_target_labels,
)

FIXTURES = Path(__file__).parent / "fixtures"
# The exporters below listen on loopback, which the scraper refuses unless allowed (SSRF), as a deployment
# that scrapes its own host sets KVPILOT_SCRAPE_ALLOW_NETS=127.0.0.0/8.
LOOPBACK = AddressPolicy(LOOPBACK_NETS)
VLLM_SERIES = 382  # stored series of fixtures/vllm_dp2.prom (cache_config_info included, one per engine)
NOW = 1_760_000_000.0
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def page(name: str) -> tuple[int, str]:
    return 200, (FIXTURES / name).read_text()


class _Exporter(http.server.BaseHTTPRequestHandler):
    pages: ClassVar[dict[str, tuple[int, str]]] = {}

    def do_GET(self) -> None:
        if self.path == "/trickle":  # a byte every 0.3 s, forever: never trips a read timeout
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:
                pass
            return
        status, body = self.pages.get(self.path, (404, "not found"))
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def exporter() -> Iterator[str]:
    _Exporter.pages = {
        "/vllm": page("vllm_dp2.prom"),
        "/qwen": page("vllm_qwen.prom"),
        "/sglang": page("sglang.prom"),
        "/dcgm": page("dcgm.prom"),
        "/broken": (200, "this is { not prometheus"),
        "/err": (500, "oops"),
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def add_targets(engine: Engine, *targets: dict[str, Any]) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(ScrapeTarget.__table__),
            [
                {"job": "x", "interval_s": 10.0, "enabled": True, "created_at": 0.0, "labels": "{}", **t}
                for t in targets
            ],
        )


def stored(engine: Engine, *, instance: str, name: str | None = None) -> list[tuple[str, dict[str, str], float, float]]:
    """Raw rows of one instance: (name, labels, ts, value)."""
    sp = SeriesPoint.__table__
    stmt = select(sp.c.name, sp.c.labels, sp.c.ts, sp.c.value).where(sp.c.instance == instance)
    if name is not None:
        stmt = stmt.where(sp.c.name == name)
    with engine.connect() as conn:
        rows = conn.execute(stmt.order_by(sp.c.ts, sp.c.id)).all()
    return [(n, json.loads(labels), ts, v) for n, labels, ts, v in rows]


def target_row(engine: Engine, instance: str) -> Any:
    t = ScrapeTarget.__table__
    with engine.connect() as conn:
        return conn.execute(select(t).where(t.c.instance == instance)).one()


def test_scraper_stores_labelled_series_and_health(db_engine: Engine, exporter: str) -> None:
    from plumbing.process import free_port

    add_targets(
        db_engine,
        {
            "url": f"{exporter}/vllm",
            "job": "vllm",
            "instance": "vllm-0",
            "labels": '{"cluster":"west","engine":"vllm"}',
        },
        {"url": f"{exporter}/qwen", "job": "vllm", "instance": "vllm-1"},
        {"url": f"{exporter}/sglang", "job": "sglang", "instance": "sglang-0"},
        {"url": f"{exporter}/dcgm", "job": "dcgm", "instance": "node-0", "labels": '{"cluster":"west"}'},
        {"url": f"{exporter}/broken", "instance": "broken"},
        {"url": f"{exporter}/err", "instance": "err"},
        {"url": f"http://127.0.0.1:{free_port()}/metrics", "instance": "dead"},
    )
    scraper = Scraper(db_engine, policy=LOOPBACK, timeout_s=2.0, clock=lambda: NOW)
    try:
        outcomes = {o.url.rsplit("/", 1)[-1]: o for o in scraper.run_once()}
        assert scraper.due_targets(NOW + 5) == []  # interval not elapsed
        assert len(scraper.due_targets(NOW + 10)) == 7
    finally:
        scraper.stop()
    assert outcomes["vllm"].up and outcomes["vllm"].points == VLLM_SERIES and outcomes["vllm"].dropped == {}
    assert not outcomes["broken"].up and not outcomes["err"].up and not outcomes["metrics"].up
    assert "HTTP 500" in (outcomes["err"].error or "")

    # Target labels on every point; the scraped `engine` collides with the target's and becomes exported_engine.
    kv = stored(db_engine, instance="vllm-0", name="kv_usage")
    static = {"cluster": "west", "engine": "vllm"}
    assert [(labels, v) for _, labels, _, v in kv] == [
        ({**static, "exported_engine": "0", "model_name": LLAMA}, 0.25),
        ({**static, "exported_engine": "1", "model_name": LLAMA}, 0.5),
    ]
    assert [labels for _, labels, _, _ in stored(db_engine, instance="vllm-0", name="up")] == [static]
    # The second vLLM server keeps its own model; no label it did not expose.
    assert [(labels, v) for _, labels, _, v in stored(db_engine, instance="vllm-1", name="running")] == [
        ({"engine": "0", "model_name": "Qwen/Qwen2.5-7B-Instruct"}, 4.0)
    ]
    # Aborted requests are stored apart from finished ones.
    requests = stored(db_engine, instance="vllm-0", name="requests_total")
    by_status: dict[str, float] = {}
    for _, labels, _, v in requests:
        assert "instance" not in labels and "job" not in labels
        by_status[labels["status"]] = by_status.get(labels["status"], 0.0) + v
    assert by_status == {"finished": 28 + 8 + 18 + 5, "aborted": 4 + 2}
    # Histogram buckets with le, next to _sum and _count.
    ttft = stored(db_engine, instance="vllm-0", name="ttft_seconds_bucket")
    assert len(ttft) == 2 * 17 and {labels["le"] for _, labels, _, _ in ttft} >= {"0.1", "1", "+Inf"}
    # DCGM: one series per GPU and per MIG instance, each with its own total.
    mem = {
        (name, json.dumps(labels, sort_keys=True)): v
        for name, labels, _, v in stored(db_engine, instance="node-0")
        if name.startswith("memory_")
    }
    totals = {labels: v for (name, labels), v in mem.items() if name == "memory_total_bytes"}
    assert len(totals) == 5
    for labels, total in totals.items():
        assert json.loads(labels)["cluster"] == "west"
        assert 0 < mem[("memory_used_bytes", labels)] / total <= 1.0
    mig = [json.loads(labels) for labels in totals if "GPU_I_ID" in labels]
    assert sorted(m["GPU_I_ID"] for m in mig) == ["1", "2"]

    up = {inst: stored(db_engine, instance=inst, name="up")[0][3] for inst in ("vllm-0", "sglang-0", "dead")}
    assert up == {"vllm-0": 1.0, "sglang-0": 1.0, "dead": 0.0}
    health = target_row(db_engine, "vllm-0")
    assert health.up is True and health.last_error is None and health.last_scrape_at == NOW
    assert health.scrape_duration_s is not None
    dead = target_row(db_engine, "dead")
    # Health names the class of failure, never the upstream's text or the socket error (port mapping).
    assert dead.up is False and dead.last_error == "connection failed"
    assert target_row(db_engine, "broken").last_error == "not a Prometheus text exposition"
    assert "oops" not in (target_row(db_engine, "err").last_error or "")
    with db_engine.connect() as conn:
        instances = {r.name: r for r in conn.execute(select(Instance.__table__)).all()}
    assert set(instances) == {"vllm-0", "vllm-1", "sglang-0", "node-0", "broken", "err", "dead"}
    assert instances["vllm-0"].first_seen_ts == instances["vllm-0"].last_seen_ts == NOW


def test_counter_resets_are_stored_as_scraped(db_engine: Engine, exporter: str) -> None:
    add_targets(db_engine, {"url": f"{exporter}/vllm", "instance": "vllm-0", "interval_s": 15.0})
    clock = iter([NOW, NOW + 15])
    scraper = Scraper(db_engine, policy=LOOPBACK, timeout_s=2.0, clock=lambda: next(clock))
    try:
        scraper.run_once(now=NOW)
        _Exporter.pages["/vllm"] = page("vllm_dp2_restarted.prom")  # the server restarted in between
        scraper.run_once(now=NOW + 15)
    finally:
        scraper.stop()
    e0 = {"engine": "0", "model_name": LLAMA}
    stop = [(ts, v) for _, labels, ts, v in stored(db_engine, instance="vllm-0", name="requests_total")
            if labels == {**e0, "finished_reason": "stop", "status": "finished"}]  # fmt: skip
    assert stop == [(NOW, 28.0), (NOW + 15, 3.0)]
    prompt = [(ts, v) for _, labels, ts, v in stored(db_engine, instance="vllm-0", name="prompt_tokens_total")
              if labels == e0]  # fmt: skip
    assert prompt[1][1] < prompt[0][1]
    with db_engine.connect() as conn:
        inst = conn.execute(select(Instance.__table__).where(Instance.name == "vllm-0")).one()
    assert (inst.first_seen_ts, inst.last_seen_ts) == (NOW, NOW + 15)


def test_sample_limit_keeps_whole_histograms_counts_and_logs(
    db_engine: Engine, exporter: str, caplog: pytest.LogCaptureFixture
) -> None:
    add_targets(db_engine, {"url": f"{exporter}/vllm", "instance": "vllm-0", "sample_limit": 100})
    registry = CollectorRegistry()
    scraper = Scraper(db_engine, policy=LOOPBACK, timeout_s=2.0, clock=lambda: NOW, metrics=ScrapeMetrics(registry))
    try:
        with caplog.at_level(logging.WARNING, logger="collector.scraper"):
            (outcome,) = scraper.run_once()
    finally:
        scraper.stop()
    assert outcome.up and outcome.dropped == {"sample_limit": VLLM_SERIES - outcome.points}
    assert 100 - 17 < outcome.points <= 100
    rows = stored(db_engine, instance="vllm-0")
    series = [
        (n, labels) for n, labels, _, _ in rows if n not in ("up", "scrape_duration_seconds", "scrape_series_dropped")
    ]
    assert len(series) == outcome.points
    # Every non-bucket series (64, two cache_config_info) is kept before any bucket; a histogram whole or not at all.
    assert sum(not n.endswith("_bucket") for n, _ in series) == 64
    histograms: dict[tuple[str, str], int] = {}
    for n, labels in series:
        if n.endswith("_bucket"):
            key = (n, labels_json({k: v for k, v in labels.items() if k != "le"}))
            histograms[key] = histograms.get(key, 0) + 1
    assert histograms and all(count == 17 for count in histograms.values())  # 16 bounds and +Inf
    dropped = [v for n, _, _, v in rows if n == "scrape_series_dropped"]
    assert dropped == [VLLM_SERIES - outcome.points]
    assert registry.get_sample_value("kvpilot_collector_scrape_series_dropped_total", {"reason": "sample_limit"}) == (
        VLLM_SERIES - outcome.points
    )
    warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == 1
    assert f"dropped {VLLM_SERIES - outcome.points} of {VLLM_SERIES} series" in warnings[0]
    assert "sample_limit 100" in warnings[0]
    health = target_row(db_engine, "vllm-0")
    assert health.up is True and (health.last_error or "").startswith("degraded: stored")


def test_label_bounds_drop_series_instead_of_truncating() -> None:
    long = "m" * (MAX_LABEL_VALUE_CHARS + 1)
    points = [
        Point("running", {"model_name": long, "engine": "0"}, 1.0),
        Point("running", {"model_name": "ok", "engine": "0"}, 2.0),
        Point("running", {"model_name": "ok", "engine": "1"}, 3.0),
    ]
    many = {f"l{i}": "v" for i in range(31)}  # 31 + the 2 scraped labels > MAX_LABELS
    bounded = bound_series(points, target_labels=many, sample_limit=10)
    assert bounded.series == [] and bounded.dropped == {"label_count": 3}
    bounded = bound_series(points, target_labels={"node": "a"}, sample_limit=1)
    assert bounded.series == [("running", labels_json({"engine": "0", "model_name": "ok", "node": "a"}), 2.0)]
    assert bounded.dropped == {"label_value_length": 1, "sample_limit": 1}


def test_target_labels_win_and_scraped_ones_are_exported() -> None:
    merged = with_target_labels({"node": "scraped", "exported_node": "x", "gpu": "0"}, {"node": "target"})
    assert merged == {"node": "target", "exported_exported_node": "scraped", "exported_node": "x", "gpu": "0"}


def test_validate_target_labels() -> None:
    assert validate_target_labels({"node": "gpu-1", "cluster": "west"}) == '{"cluster":"west","node":"gpu-1"}'
    assert validate_target_labels({}) == "{}"
    for bad in (
        {"__meta": "x"},
        {"1node": "x"},
        {"no-dash": "x"},
        {"instance": "x"},
        {"job": "x"},
        {"le": "1"},
        {"node": ""},
        {"node": "x" * (MAX_LABEL_VALUE_CHARS + 1)},
        {"node": "a\x00b"},
        {f"l{i}": "v" for i in range(33)},
    ):
        with pytest.raises(TargetLabelsError):
            validate_target_labels(bad)
    assert validate_sample_limit(10_000) == 10_000
    for bad_limit in (0, -1, 10**7, True):
        with pytest.raises(TargetLabelsError):
            validate_sample_limit(bad_limit)


def test_a_trickling_target_neither_outlives_its_deadline_nor_delays_others(db_engine: Engine, exporter: str) -> None:
    add_targets(
        db_engine,
        {"url": f"{exporter}/trickle", "instance": "slow", "interval_s": 1.0},
        {"url": f"{exporter}/dcgm", "instance": "fast", "interval_s": 1.0},
    )
    scraper = Scraper(db_engine, policy=LOOPBACK, timeout_s=1.0, tick_s=0.1)
    scraper.start()
    try:
        time.sleep(3.5)
    finally:
        scraper.stop()
    fast = [v for n, _, _, v in stored(db_engine, instance="fast", name="up")]
    slow = target_row(db_engine, "slow")
    assert len(fast) >= 3, fast  # about one scrape a second, while the slow target hangs on
    assert slow.up is False and slow.last_error == "deadline of 1s exceeded"
    assert slow.scrape_duration_s < 2.0
