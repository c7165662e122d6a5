"""The ingest hot path's validator: the wire schema of `engine.events`, validated into plain dicts.

Validating into the frozen pydantic models costs twice as much as validating the same schema into
TypedDicts, and the collector only needs the values to hand to `executemany`. So the TypedDicts are
generated here from the models' own fields (types, constraints, defaults), not written by hand: the
two cannot drift apart, and a differential test (tests/collector/test_validation.py) checks that both
accept and reject the same inputs, except for one deliberate difference: the mirror also refuses what
no column can hold (integers or strings wider than their column, infinite or NaN floats), as a 422.
A model that grows its own validators cannot be mirrored; then the models themselves are used
(`FAST_PATH` is False, without the storage bounds) and a test fails to say so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from types import UnionType
from typing import Annotated, Any, NotRequired, Required, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from sqlalchemy import BigInteger, Float, Integer, String
from typing_extensions import TypedDict

from collector.schema import EVENT_TABLES
from collector.settings import CollectorSettings
from collector.wirescan import BatchShapeError, split_batch
from engine.events import EVENT_TYPES, EventBatch, event_adapter

log = logging.getLogger(__name__)


def _mirrorable() -> bool:
    for model in EVENT_TYPES.values():
        decorators = model.__pydantic_decorators__
        if any((decorators.validators, decorators.field_validators, decorators.model_validators)):
            return False
    return True


# What the columns can hold, on top of the wire schema: integers within the column's width (INTEGER is
# 32-bit on PostgreSQL), finite floats and strings within VARCHAR lengths. Without these an out-of-range
# value would fail in the database (a 5xx, retried forever by senders) instead of a 422 up front.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _storage_bound(column: Any) -> Any:
    if isinstance(column.type, BigInteger):
        return Field(ge=-INT64_MAX, le=INT64_MAX)
    if isinstance(column.type, Integer):
        return Field(ge=-INT32_MAX, le=INT32_MAX)
    if isinstance(column.type, Float):
        return Field(allow_inf_nan=False)
    if isinstance(column.type, String) and column.type.length:
        return Field(max_length=column.type.length)
    return None


def _bounded(annotation: Any, bound: Any) -> Any:
    """Add `bound` to the int/float inside `annotation` (which may be Annotated or `X | None`)."""
    if bound is None:
        return annotation
    if annotation in (int, float, str):
        return Annotated[annotation, bound]
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *meta = get_args(annotation)
        # the bound goes first: the model's own (tighter) constraints, applied after it, win
        return Annotated[(base, bound, *meta)] if base in (int, float, str) else annotation
    if origin in (Union, UnionType):
        return Union[tuple(_bounded(arg, bound) for arg in get_args(annotation))]  # noqa: UP007
    return annotation


def _typed_dict(model: type[BaseModel], table: Any) -> tuple[type, dict[str, Any]]:
    fields: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        base = _bounded(info.annotation, _storage_bound(table.c[name]) if name in table.c else None)
        annotation = Annotated[(base, *info.metadata)] if info.metadata else base
        if info.is_required():
            fields[name] = Required[annotation]
        else:
            fields[name] = NotRequired[annotation]
            defaults[name] = info.get_default(call_default_factory=True)
    td = TypedDict(f"{model.__name__}Wire", fields)  # type: ignore[misc]  # fields known only at run time
    td.__pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[attr-defined]  # where pydantic reads it
    return td, defaults


FAST_PATH = _mirrorable()
DEFAULTS: dict[str, dict[str, Any]] = {}

if FAST_PATH:
    _mirrors = []
    for _kind, _model in EVENT_TYPES.items():
        _td, DEFAULTS[_kind] = _typed_dict(_model, EVENT_TABLES[_kind])
        _mirrors.append(_td)
    _WireEvent: Any = Annotated[Union[tuple(_mirrors)], Field(discriminator="type")]  # noqa: UP007

    class WireBatch(TypedDict, total=False):
        __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]  # pydantic's TypedDict config key

        idempotency_key: Annotated[str, Field(min_length=1, max_length=200)] | None
        events: Required[Annotated[list[_WireEvent], Field(max_length=100_000)]]

    wire_adapter: TypeAdapter[Any] = TypeAdapter(WireBatch)
    event_wire_adapter: TypeAdapter[Any] = TypeAdapter(_WireEvent)
else:  # pragma: no cover - exercised only if events.py grows validators
    log.warning("engine.events models have validators; ingest validates through the models (slower)")
    wire_adapter = TypeAdapter(EventBatch)


WHOLE_BODY_BYTES = 64 * 1024  # pydantic may judge a body this small whole: its errors stay within tens of MB
MAX_ERRORS = 20  # validation stops here: each error holds its input, and nobody reads the 21st


def validate_wire(body: bytes, *, max_events: int = 100_000) -> tuple[str | None, list[dict[str, Any]]]:
    """(idempotency key, events as dicts with every field present); raises pydantic.ValidationError
    (at most MAX_ERRORS errors), TooManyEventsError (counted before anything is validated) or
    BatchShapeError (a large body that is not a batch of flat objects; a small one gets pydantic's words).

    Events are validated one at a time from their own bytes (`wirescan.split_batch`), never the whole
    body at once: what a body can cost is bounded by `max_events` events of at most 16 KiB each.
    """
    if not FAST_PATH:  # pragma: no cover
        batch = wire_adapter.validate_json(body)
        return batch.idempotency_key, [dict(e.__dict__) for e in batch.events]
    try:
        key_json, raw_events = split_batch(body, max_events=max_events)
    except BatchShapeError:
        if len(body) <= WHOLE_BODY_BYTES:
            wire_adapter.validate_json(body)  # names the offending field as pydantic does; never passes here
        raise
    key = wire_adapter.validate_json(b'{"events":[],"idempotency_key":' + key_json + b"}").get("idempotency_key")
    events: list[dict[str, Any]] = []
    errors: list[Any] = []
    for i, raw in enumerate(raw_events):
        try:
            event = event_wire_adapter.validate_json(raw)
        except ValidationError as exc:
            for err in exc.errors(include_url=False)[: MAX_ERRORS - len(errors)]:
                detail = {"type": err["type"], "loc": ("events", i, *err["loc"]), "input": err["input"]}
                errors.append({**detail, "ctx": err["ctx"]} if "ctx" in err else detail)
            if len(errors) >= MAX_ERRORS:
                break
            continue
        if not errors:
            defaults = DEFAULTS[event["type"]]
            events.append(event if len(event) == len(defaults) + _REQUIRED[event["type"]] else {**defaults, **event})
    if errors:
        raise ValidationError.from_exception_data("WireBatch", errors)
    return key, events


def validate_event(data: dict[str, Any]) -> dict[str, Any]:
    """One event built by a source adapter (OTLP spans), validated exactly as in a pushed batch.

    Returns the event with every field present; raises pydantic.ValidationError naming the field.
    """
    if not FAST_PATH:  # pragma: no cover
        return dict(event_adapter.validate_python(data).__dict__)
    event = event_wire_adapter.validate_python(data)
    return {**DEFAULTS[event["type"]], **event}


_REQUIRED = {kind: len(model.model_fields) - len(DEFAULTS.get(kind, {})) for kind, model in EVENT_TYPES.items()}


@dataclass(frozen=True)
class TimeWindow:
    """The event times a collector stores: from its raw retention back to a clock skew ahead of now.

    The schema alone takes any positive float, so an event stamped 1970 or 1e308 was stored, and a run
    stamped 1e308 sorted first in every "latest" list forever. Older than the raw retention, an event
    would be pruned at the next `kvpilot db prune` anyway; further ahead than the skew, it is a broken
    clock. The bound depends on now, so it is checked after the (static) schema, at the push boundary.
    """

    earliest: float
    latest: float

    @classmethod
    def for_settings(cls, settings: CollectorSettings, now: float | None = None) -> TimeWindow:
        now = time.time() if now is None else now
        return cls(now - settings.raw_retention_days * 86_400.0, now + settings.max_clock_skew_s)

    def __contains__(self, ts: float) -> bool:
        return self.earliest <= ts <= self.latest

    def message(self) -> str:
        """Why a time is refused, with the bounds (never the value itself, which may be enormous)."""
        return (
            f"must be within the raw retention and the allowed clock skew: {_iso(self.earliest)} .. {_iso(self.latest)}"
        )


def _iso(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):  # a retention of millennia: past what a datetime holds
        return f"{ts:.0f} (epoch seconds)"
