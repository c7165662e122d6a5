"""The ingest validator (TypedDicts generated from engine.events) agrees with the models themselves."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import BigInteger, Integer, String

from collector import fastdecode, validation
from collector.ingest import EVENT_COLUMNS
from collector.schema import EVENT_TABLES
from engine.events import EventBatch
from tests.collector import evfactory as ev

model_adapter = TypeAdapter(EventBatch)
BASES = [
    ev.request(1),
    ev.step(2),
    ev.alloc(3),
    ev.sample(4),
    ev.request(5, ttft_s=None, finish_reason="stop", swaps=1, swap_s=0.25),
]
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**31)]),
    st.text(min_size=60, max_size=210),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.sampled_from(["request", "step", "alloc", "sample", "finished", "hot", "oom", "1", "1.5", "", "true"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
FIELDS = sorted({k for e in BASES for k in e} | {"unknown", "v", "type"})


@st.composite
def mutated_event(draw: st.DrawFn) -> dict[str, Any]:
    event = dict(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()) and field in event:
            del event[field]
        else:
            event[field] = draw(ODD_VALUES)
    return event


def fits_columns(event: dict[str, Any]) -> bool:
    """The collector's deliberate extra: values must fit their SQL columns (see collector/validation.py)."""
    table = EVENT_TABLES[event["type"]]
    for name, value in event.items():
        if name not in table.c or value is None or isinstance(value, bool):
            continue
        col = table.c[name].type
        if isinstance(value, int) and isinstance(col, Integer):
            limit = validation.INT64_MAX if isinstance(col, BigInteger) else validation.INT32_MAX
            if abs(value) > limit:
                return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if isinstance(value, str) and isinstance(col, String) and col.length and len(value) > col.length:
            return False
    return True


def model_result(body: bytes) -> tuple[bool, Any]:
    try:
        batch = model_adapter.validate_json(body)
    except ValidationError as exc:
        return False, sorted(tuple(e["loc"]) for e in exc.errors())
    events = [e.model_dump() for e in batch.events]
    if not all(fits_columns(e) for e in events):
        return False, "out of column range"
    return True, events


def wire_result(body: bytes) -> tuple[bool, Any]:
    try:
        _key, events = validation.validate_wire(body)
    except ValidationError as exc:
        return False, sorted(tuple(e["loc"]) for e in exc.errors())
    return True, events


def test_fast_path_is_active() -> None:
    assert validation.FAST_PATH, "engine.events grew validators; teach collector/validation.py about them"


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(mutated_event(), min_size=1, max_size=3))
def test_mirror_accepts_and_rejects_exactly_like_the_models(events: list[dict[str, Any]]) -> None:
    body = json.dumps({"events": events}, allow_nan=True).encode()
    expected_ok, expected = model_result(body)
    ok, got = wire_result(body)
    assert ok == expected_ok, (events, expected, got)
    if ok:
        assert got == expected
    elif expected != "out of column range":
        # every field the models name is named too (the mirror may add column-range errors), unless the mirror
        # stopped at MAX_ERRORS with more than that many to name (a request's fields under "type": "step")
        assert len(got) <= validation.MAX_ERRORS, got
        assert set(expected) <= set(got) or (
            len(got) == validation.MAX_ERRORS and len(set(expected) | set(got)) > validation.MAX_ERRORS
        ), (expected, got)


def test_the_mirror_stops_at_max_errors_where_the_models_name_more() -> None:
    """A request's fields under "type": "step" (19 of them forbidden there) after a request with one unknown
    field: the models name 21 errors, the mirror its first MAX_ERRORS, all of them among the models'."""
    misplaced = {**ev.request(1), "type": "step", "block_size": None}
    body = json.dumps({"events": [{**ev.request(1), "block_size": None}, misplaced]}).encode()
    _, expected = model_result(body)
    ok, got = wire_result(body)
    assert not ok and len(expected) > validation.MAX_ERRORS
    assert len(got) == validation.MAX_ERRORS and set(got) <= set(expected)


def test_defaults_are_filled() -> None:
    minimal = {k: v for k, v in ev.request(0).items() if k not in ("v", "priority", "warmup")}
    _key, (event,) = validation.validate_wire(json.dumps({"events": [minimal]}).encode())
    assert event["v"] == 1 and event["priority"] == 1 and event["warmup"] is False and event["swaps"] == 0
    assert event["swap_s"] == 0.0


def test_msgspec_fast_path_is_active() -> None:
    assert fastdecode.ENABLED, "collector.fastdecode could not mirror engine.events; see its log line"


def pydantic_rows(body: bytes) -> tuple[str | None, dict[str, list[tuple]]] | None:
    try:
        key, events = validation.validate_wire(body)
    except ValidationError:
        return None
    rows: dict[str, list[tuple]] = {}
    for e in events:
        rows.setdefault(e["type"], []).append(tuple(e[c] for c in EVENT_COLUMNS[e["type"]]))
    return key, rows


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(mutated_event(), min_size=0, max_size=3), st.booleans(), st.one_of(st.none(), st.text(max_size=3)))
def test_msgspec_accepts_only_what_pydantic_accepts_with_equal_rows(
    events: list[dict[str, Any]], ascii_only: bool, key: str | None
) -> None:
    payload: dict[str, Any] = {"events": events}
    if key is not None:
        payload["idempotency_key"] = key
    body = json.dumps(payload, allow_nan=True, ensure_ascii=ascii_only).encode()
    fast = fastdecode.decode(body)
    if fast is None:
        return  # the pydantic path decides
    reference = pydantic_rows(body)
    assert reference is not None, ("msgspec accepted what pydantic refuses", events)
    assert fast == reference
    for kind, rows in fast[1].items():
        for fast_row, ref_row in zip(rows, reference[1][kind], strict=True):
            assert [type(v) for v in fast_row] == [type(v) for v in ref_row]


def test_fast_path_declines_escapes_and_lax_input() -> None:
    assert fastdecode.decode(ev.body([ev.sample(0)])) is not None
    assert fastdecode.decode(ev.body([ev.sample(0, source="caf\u00e9")])) is None  # \\u escape: pydantic path
    assert fastdecode.decode(ev.body([ev.sample(0, queue_depth="3")])) is None  # lax input: pydantic path
