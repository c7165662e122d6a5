"""POST /v1/ingest against bodies crafted to cost more than they weigh: each is refused before the work it bounds.

Small gzip bodies once became gigabytes in the pydantic fallback (every event validated, every error
collected, the event count checked last). These assert the answer and that the work stopped early: the
events validated are counted with a spy on the validator.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from collector import validation
from collector.ingest import BatchTooLargeError, BatchValidationError, parse_batch
from collector.server import create_app
from collector.settings import CollectorSettings
from collector.wirescan import MAX_EVENT_BYTES, json_values_bound, split_batch
from tests.collector import evfactory as ev

TOKEN = "s3cret"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", "Content-Encoding": "gzip"}


class Spy:
    """The per-event validator, counting the events it was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def validate_json(self, data: bytes) -> Any:
        self.calls += 1
        return self.inner.validate_json(data)

    def validate_python(self, data: Any) -> Any:
        return self.inner.validate_python(data)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    watched = Spy(validation.event_wire_adapter)
    monkeypatch.setattr(validation, "event_wire_adapter", watched)
    return watched


@pytest.fixture
def client(sqlite_url: str) -> Iterator[TestClient]:
    settings = CollectorSettings(db_url=sqlite_url, ingest_token=TOKEN, scrape_enabled=False, max_batch_events=1000)
    with TestClient(create_app(settings)) as c:
        yield c


def unknown_keys(events: int, keys: int) -> bytes:
    event = {"type": "request", **{f"k{j}": 0 for j in range(keys)}}
    return json.dumps({"events": [event] * events}).encode()


def test_validation_stops_at_20_errors(spy: Spy) -> None:
    with pytest.raises(BatchValidationError) as caught:
        parse_batch(unknown_keys(2000, 100), max_events=20_000)
    assert len(caught.value.errors) == 20
    assert caught.value.errors[0]["loc"] == "events[0].instance"
    assert spy.calls == 1  # the first event had 20 errors: no other was validated


def test_event_count_is_checked_before_any_event_is_validated(spy: Spy) -> None:
    body = b'{"events":[' + b",".join([b'{"type":"request"}'] * 99_999) + b"]}"
    with pytest.raises(BatchTooLargeError, match="more than 20000 events"):
        parse_batch(body, max_events=20_000)
    assert spy.calls == 0


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        (b'{"events":[{"type":"request","x":[' + b"0," * 500_000 + b"0]}]}", "events[0]"),
        (b'{"events":[' + b'{"type":"request","x":"' + b"a" * (4 * MAX_EVENT_BYTES + 1) + b'"}]}', "events[0]"),
        (b"{" + b"".join(b'"k%d":0,' % i for i in range(100_000)) + b'"events":[]}', "(body)"),
        (b'{"events":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "(body)"),
    ],
    ids=["nested-value", "huge-event", "many-top-level-keys", "deep-nesting"],
)
def test_large_shapes_that_are_not_batches_are_refused_unvalidated(spy: Spy, body: bytes, loc: str) -> None:
    assert len(body) > validation.WHOLE_BODY_BYTES  # too large to hand pydantic whole
    with pytest.raises(BatchValidationError) as caught:
        parse_batch(body, max_events=20_000)
    assert caught.value.errors[0]["loc"] == loc
    assert spy.calls == 0


def test_small_malformed_bodies_keep_pydantics_words() -> None:
    with pytest.raises(BatchValidationError) as caught:
        parse_batch(b'{"events": [{"type": "request", "instance": 5}], "extra": 1}', max_events=10)
    assert {e["loc"] for e in caught.value.errors} >= {"extra"}


def test_valid_batches_with_escapes_still_pass() -> None:
    """Bodies with \\u escapes always take the bounded path: it accepts what it should."""
    events = ev.mixed(40)
    events[0]["instance"] = "caf\u00e9-\U0001f600"
    body = json.dumps({"events": events, "idempotency_key": "k-1"}).encode()  # ensure_ascii: \\u escapes
    batch = parse_batch(body, max_events=40)
    assert batch.count == 40 and batch.idempotency_key == "k-1"
    with pytest.raises(BatchTooLargeError):
        parse_batch(body, max_events=39)


def test_split_batch_counts_while_finding() -> None:
    key, events = split_batch(b' {"events" : [ {"a": "}]"} , {} ] , "idempotency_key": "x"} ', max_events=2)
    assert key == b'"x"' and events == [b'{"a": "}]"}', b"{}"]


def test_json_values_bound_is_an_upper_bound() -> None:
    doc = {"a": [1, 2, {"b": "x,y:[z"}], "c": {"d": [], "e": [[]]}}
    values = 1 + 1 + 3 + 1 + 1 + 2 + 1  # root, a, a's three, b, c, d and e, e's one
    assert values <= json_values_bound(json.dumps(doc).encode()) <= 2 * values


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (unknown_keys(1000, 100), 422),
        (b'{"events":[' + b",".join([b'{"type":"request"}'] * 99_999) + b"]}", 413),
        (b'{"events":[' + b"{}," * 3_000_000 + b"{}]}", 413),
    ],
    ids=["unknown-keys", "missing-fields", "empty-events"],
)
def test_amplifying_gzip_bodies_are_refused(client: TestClient, spy: Spy, body: bytes, status: int) -> None:
    wire = gzip.compress(body, 9)
    assert len(wire) < len(body) // 50  # small on the wire
    resp = client.post("/v1/ingest", content=wire, headers=HEADERS)
    assert resp.status_code == status, resp.text
    assert len(resp.json().get("errors") or []) <= 20
    assert spy.calls <= 1
    metrics = client.get("/metrics").text
    reason = "invalid" if status == 422 else "too_many_events"
    assert f'kvpilot_collector_ingest_rejected_total{{reason="{reason}"}} 1.0' in metrics
