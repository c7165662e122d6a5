"""The ingest validator (TypedDicts generated from collector.events) agrees with the models themselves."""

from __future__ import annotations

import json
from typing import Any

import evfactory as ev
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from collector import validation
from collector.events import EventBatch

model_adapter = TypeAdapter(EventBatch)
BASES = [ev.request(1), ev.step(2), ev.alloc(3), ev.sample(4), ev.request(5, ttft_s=None, finish_reason="stop")]
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
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


def model_result(body: bytes) -> tuple[bool, Any]:
    try:
        batch = model_adapter.validate_json(body)
    except ValidationError as exc:
        return False, sorted(tuple(e["loc"]) for e in exc.errors())
    return True, [e.model_dump() for e in batch.events]


def wire_result(body: bytes) -> tuple[bool, Any]:
    try:
        _key, events = validation.validate_wire(body)
    except ValidationError as exc:
        return False, sorted(tuple(e["loc"]) for e in exc.errors())
    return True, events


def test_fast_path_is_active() -> None:
    assert validation.FAST_PATH, "collector.events grew validators; teach collector/validation.py about them"


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(mutated_event(), min_size=1, max_size=3))
def test_mirror_accepts_and_rejects_exactly_like_the_models(events: list[dict[str, Any]]) -> None:
    body = json.dumps({"events": events}, allow_nan=True).encode()
    expected_ok, expected = model_result(body)
    ok, got = wire_result(body)
    assert ok == expected_ok, (events, expected, got)
    if ok:
        assert got == expected
    else:
        assert got == expected  # same error locations, so the 422 names the same fields


def test_defaults_are_filled() -> None:
    minimal = {k: v for k, v in ev.request(0).items() if k not in ("v", "priority", "warmup")}
    _key, (event,) = validation.validate_wire(json.dumps({"events": [minimal]}).encode())
    assert event["v"] == 1 and event["priority"] == 1 and event["warmup"] is False and event["swaps"] == 0
