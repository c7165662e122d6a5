"""engine.http_sink.HttpSink: batching, never blocking, bounded queue and spool, ordered drain."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.events import SampleEvent, StepEvent
from engine.http_sink import DiskSpool, HttpSink, SpooledBatch
from engine.sinks import EventSink


def sample(i: int) -> SampleEvent:
    return SampleEvent(instance="e0", run_id="r", ts=1.7e9 + i, queue_depth=i)


class FakeCollector:
    """An httpx MockTransport that records accepted batches and can be switched down."""

    def __init__(self) -> None:
        self.up = True
        self.status = 202
        self.bodies: list[tuple[str, bytes]] = []
        self.attempts = 0
        self.probes = 0
        self.lock = threading.Lock()

    def handler(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            if not self.up:
                raise httpx.ConnectError("connection refused", request=request)
            if request.url.path == "/health":
                self.probes += 1
                return httpx.Response(200, json={"status": "ok"})
            self.attempts += 1
            if self.status < 300:
                self.bodies.append((request.headers["idempotency-key"], request.content))
            return httpx.Response(self.status, json={"detail": "x"})

    def events(self) -> list[int]:
        import gzip
        import json

        out = []
        for _, body in self.bodies:
            data = json.loads(gzip.decompress(body))
            out.extend(e["queue_depth"] for e in data["events"] if e["type"] != "gap")
        return out


@pytest.fixture
def fake() -> FakeCollector:
    return FakeCollector()


def make_sink(fake: FakeCollector, **kw) -> HttpSink:
    opts = {"batch_size": 50, "flush_interval_s": 0.05, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
    opts.update(kw)
    return HttpSink("http://collector.test", client=httpx.Client(transport=httpx.MockTransport(fake.handler)), **opts)


@pytest.fixture
def sink(fake: FakeCollector) -> Iterator[HttpSink]:
    s = make_sink(fake, flush_on_sample=False)  # cuts by size and time only
    yield s
    s.close()


def step(i: int) -> StepEvent:
    return StepEvent(
        instance="e0", run_id="r", ts=1.7e9 + i, step=i, duration_s=0.01, forward_s=0.01, num_seqs=1,
        prefill_tokens=0, decode_tokens=1, kv_blocks_used=1, kv_blocks_total=8, queue_depth=i, busy_s=0.01,
    )  # fmt: skip


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_sample_is_pushed_at_once_with_what_is_queued(fake: FakeCollector) -> None:
    s = make_sink(fake, flush_interval_s=60.0)  # the timer never fires in this test
    try:
        s.emit(step(1))
        s.emit(step(2))
        time.sleep(0.3)
        assert fake.bodies == []  # steps wait for the flush interval
        s.emit(sample(3))
        assert wait_for(lambda: fake.events() == [1, 2, 3])
        assert len(fake.bodies) == 1
        # another sample within a quarter of the interval since that cut waits for the timer: a burst of
        # samples is not a burst of pushes
        s.emit(sample(4))
        time.sleep(0.3)
        assert fake.events() == [1, 2, 3]
    finally:
        s.close()
    assert fake.events() == [1, 2, 3, 4]  # close flushed it


def test_without_flush_on_sample_a_sample_waits_like_any_event(fake: FakeCollector) -> None:
    s = make_sink(fake, flush_interval_s=60.0, flush_on_sample=False)
    try:
        s.emit(sample(1))
        time.sleep(0.3)
        assert fake.bodies == []
    finally:
        s.close()
    assert fake.events() == [1]


def test_is_an_event_sink(sink: HttpSink) -> None:
    assert isinstance(sink, EventSink)


def test_batches_by_size_and_time_with_idempotency_keys(sink: HttpSink, fake: FakeCollector) -> None:
    for i in range(120):
        sink.emit(sample(i))
    assert sink.wait_drained(5)
    assert fake.events() == list(range(120))
    sizes = [len(__import__("json").loads(__import__("gzip").decompress(b))["events"]) for _, b in fake.bodies]
    assert sizes[:2] == [50, 50] and sum(sizes) == 120  # the tail went by time, not size
    keys = [k for k, _ in fake.bodies]
    assert len(set(keys)) == len(keys)
    assert sink.sent == 120 and sink.dropped == 0


def test_emit_never_blocks_even_when_the_collector_hangs(fake: FakeCollector) -> None:
    release = threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        release.wait(5)
        return httpx.Response(202)

    s = HttpSink(
        "http://collector.test",
        client=httpx.Client(transport=httpx.MockTransport(slow)),
        batch_size=10,
        flush_interval_s=0.01,
        queue_size=1000,
    )
    started = time.perf_counter()
    for i in range(5000):
        s.emit(sample(i))
    elapsed = time.perf_counter() - started
    release.set()
    s.close(timeout_s=2)
    assert elapsed < 0.5, f"emit blocked: {elapsed:.3f}s for 5000 events"
    assert s.dropped_by_reason()["queue_full"] > 0


def test_full_queue_drops_and_counts(fake: FakeCollector) -> None:
    fake.up = False
    s = make_sink(fake, queue_size=10, batch_size=10_000, flush_interval_s=10)
    for i in range(25):
        s.emit(sample(i))
    assert s.dropped_by_reason()["queue_full"] == 15 and s.queued == 10
    s.close(timeout_s=0.5)


def test_spools_while_down_and_drains_in_order(fake: FakeCollector, tmp_path: Path) -> None:
    fake.up = False
    s = make_sink(fake, spool_dir=tmp_path / "spool")
    for i in range(300):
        s.emit(sample(i))
    s.flush()
    deadline = time.monotonic() + 5
    while s.spooled < 300 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.spooled == 300 and s.sent == 0
    assert len(list((tmp_path / "spool").glob("*.batch"))) >= 6
    fake.up = True
    assert s.wait_drained(10)
    assert fake.events() == list(range(300))
    assert s.sent == 300 and s.retries > 0 and s.dropped == 0
    s.close()


def test_retry_sends_the_same_key(fake: FakeCollector) -> None:
    fake.status = 503
    s = make_sink(fake)
    for i in range(10):
        s.emit(sample(i))
    s.flush()
    time.sleep(0.1)
    fake.status = 202
    assert s.wait_drained(5)
    s.close()
    assert len(fake.bodies) == 1 and fake.attempts >= 2 and s.sent == 10


def test_spool_survives_restart(fake: FakeCollector, tmp_path: Path) -> None:
    fake.up = False
    s1 = make_sink(fake, spool_dir=tmp_path)
    for i in range(120):
        s1.emit(sample(i))
    s1.close()
    assert s1.sent == 0 and len(list(tmp_path.glob("*.batch"))) == 3
    fake.up = True
    s2 = make_sink(fake, spool_dir=tmp_path)
    assert s2.wait_drained(5)
    s2.close()
    assert fake.events() == list(range(120))
    assert not list(tmp_path.glob("*.batch"))


def test_spool_bound_drops_oldest(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, max_bytes=250)
    for i in range(5):
        evicted = spool.push(SpooledBatch(f"b{i}", f"k{i}", 10, bytes([65 + i]) * 100))
    assert [b.key for b in evicted] == ["k2"]
    assert spool.bytes == 200 and len(spool) == 2
    first = spool.peek()
    assert first is not None and first.key == "k3" and first.body == b"D" * 100
    assert spool.push(SpooledBatch("big", "big", 1, b"x" * 1000))[-1].key == "big"


@pytest.mark.parametrize("status", [422, 409])
def test_permanent_rejection_is_counted_not_retried(
    fake: FakeCollector, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    fake.status = status
    s = make_sink(fake)
    with caplog.at_level("ERROR", logger="engine.http_sink"):
        for i in range(20):
            s.emit(sample(i))
        s.flush()
        s.close()
    # one attempt at the batch, one at the gap record saying it was lost (refused too: never retried)
    assert s.rejected == 20 and s.dropped_by_reason()["rejected"] == 20 and fake.attempts == 2
    refused = [r.getMessage() for r in caplog.records if "refused a batch of 20 events" in r.getMessage()]
    assert len(refused) == 1 and (("tokens reassign" in refused[0]) == (status == 409))


def test_a_new_token_in_the_token_file_resumes_a_stopped_sink(tmp_path: Path) -> None:
    """Rotation without a restart: the sink stopped on a refused secret sends again once the file changes."""
    accepted = {"new"}
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        seen.append(token)
        return httpx.Response(202 if token in accepted else 403, json={"detail": "x"})

    token_file = tmp_path / "token"
    token_file.write_text("old\n")
    s = HttpSink(
        "http://collector.test",
        token_file=token_file,
        batch_size=10,
        flush_interval_s=0.02,
        backoff_initial_s=0.01,
        backoff_max_s=0.02,
        auth_max_tries=2,
        client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    try:
        for i in range(30):
            s.emit(sample(i))
        deadline = time.monotonic() + 5
        while not s.stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.stopped and s.sent == 0 and set(seen) == {"old"}
        tmp = tmp_path / "token.tmp"
        tmp.write_text("new\n")
        tmp.replace(token_file)
        assert s.wait_drained(5.0)
        assert s.sent == 30 and not s.stopped and not any(s.dropped_by_reason().values()) and seen[-1] == "new"
    finally:
        s.close()


def test_counters_on_a_registry(fake: FakeCollector) -> None:
    registry = CollectorRegistry()
    s = make_sink(fake, registry=registry)
    for i in range(7):
        s.emit(sample(i))
    assert s.wait_drained(5)
    s.close()
    text = generate_latest(registry).decode()
    assert "kvpilot_telemetry_events_sent_total 7.0" in text
    assert "kvpilot_telemetry_events_spooled_total 0.0" in text
    assert 'kvpilot_telemetry_events_dropped_total{reason="queue_full"} 0.0' in text


def test_from_config() -> None:
    from engine.config import TelemetryConfig

    cfg = TelemetryConfig(sink="http", collector_url="http://127.0.0.1:1", spool_dir=None, http_batch_size=7)
    s = HttpSink.from_config(cfg)
    assert s.batch_size == 7 and s.endpoint == "http://127.0.0.1:1/v1/ingest" and s.flush_on_sample
    s.close(timeout_s=0.2)
    s = HttpSink.from_config(cfg.model_copy(update={"http_flush_on_sample": False}))
    assert not s.flush_on_sample
    s.close(timeout_s=0.2)


def test_token_file_from_config(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from engine.config import TelemetryConfig

    token = tmp_path / "token"
    with pytest.raises(ValidationError, match="not both"):
        TelemetryConfig(collector_token="a", collector_token_file=str(token))
    cfg = TelemetryConfig(
        sink="http", collector_url="http://127.0.0.1:1", spool_dir=None, collector_token_file=f"{token}"
    )
    with pytest.raises(ValueError, match="missing, unreadable or empty"):
        HttpSink.from_config(cfg)
    token.write_text("kvp_abc\n")
    s = HttpSink.from_config(cfg)
    assert s._token.current() == "kvp_abc"
    s.close(timeout_s=0.2)


def test_one_sink_per_spool_directory(fake: FakeCollector, tmp_path: Path) -> None:
    from engine.http_sink import SpoolLockedError

    first = make_sink(fake, spool_dir=tmp_path)
    with pytest.raises(SpoolLockedError, match=r"own telemetry\.spool_dir"):
        make_sink(fake, spool_dir=tmp_path)
    first.close()
    make_sink(fake, spool_dir=tmp_path).close()  # released on close


def test_from_config_spools_per_instance(tmp_path: Path) -> None:
    from engine.config import TelemetryConfig

    cfg = TelemetryConfig(sink="http", instance="gpu/0", collector_url="http://127.0.0.1:1", spool_dir=str(tmp_path))
    s = HttpSink.from_config(cfg)
    assert isinstance(s.spool, DiskSpool) and s.spool.dir == tmp_path / "gpu_0"
    s.close(timeout_s=0.2)
