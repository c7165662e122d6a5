"""The ingest hot path's validator: the wire schema of `collector.events`, validated into plain dicts.

Validating into the frozen pydantic models costs twice as much as validating the same schema into
TypedDicts, and the collector only needs the values to hand to `executemany`. So the TypedDicts are
generated here from the models' own fields (types, constraints, defaults), not written by hand: the
two cannot drift apart, and a differential test (tests/collector/test_validation.py) checks that both
accept and reject the same inputs. A model that grows its own validators cannot be mirrored; then the
models themselves are used (`FAST_PATH` is False) and a test fails to say so.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, NotRequired, Required, Union

from pydantic import ConfigDict, Field, TypeAdapter
from typing_extensions import TypedDict

from collector.events import EVENT_TYPES, EventBatch

log = logging.getLogger(__name__)


def _mirrorable() -> bool:
    for model in EVENT_TYPES.values():
        decorators = model.__pydantic_decorators__
        if any((decorators.validators, decorators.field_validators, decorators.model_validators)):
            return False
    return True


def _typed_dict(model: type) -> tuple[type, dict[str, Any]]:
    fields: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    for name, info in model.model_fields.items():  # type: ignore[attr-defined]
        annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        if info.is_required():
            fields[name] = Required[annotation]
        else:
            fields[name] = NotRequired[annotation]
            defaults[name] = info.get_default(call_default_factory=True)
    td = TypedDict(f"{model.__name__}Wire", fields)  # type: ignore[operator]
    td.__pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[attr-defined]
    return td, defaults


FAST_PATH = _mirrorable()
DEFAULTS: dict[str, dict[str, Any]] = {}

if FAST_PATH:
    _mirrors = []
    for _kind, _model in EVENT_TYPES.items():
        _td, DEFAULTS[_kind] = _typed_dict(_model)
        _mirrors.append(_td)
    _WireEvent = Annotated[Union[tuple(_mirrors)], Field(discriminator="type")]  # noqa: UP007

    class WireBatch(TypedDict, total=False):
        __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]

        idempotency_key: Annotated[str, Field(min_length=1, max_length=200)] | None
        events: Required[Annotated[list[_WireEvent], Field(max_length=100_000)]]  # type: ignore[valid-type]

    wire_adapter: TypeAdapter[Any] = TypeAdapter(WireBatch)
else:  # pragma: no cover - exercised only if events.py grows validators
    log.warning("collector.events models have validators; ingest validates through the models (slower)")
    wire_adapter = TypeAdapter(EventBatch)


def validate_wire(body: bytes) -> tuple[str | None, list[dict[str, Any]]]:
    """(idempotency key, events as dicts with every field present); raises pydantic.ValidationError."""
    if not FAST_PATH:  # pragma: no cover
        batch = wire_adapter.validate_json(body)
        return batch.idempotency_key, [dict(e.__dict__) for e in batch.events]
    data = wire_adapter.validate_json(body)
    events = data["events"]
    for i, event in enumerate(events):
        defaults = DEFAULTS[event["type"]]
        if len(event) != len(defaults) + _REQUIRED[event["type"]]:
            events[i] = {**defaults, **event}
    return data.get("idempotency_key"), events


_REQUIRED = {kind: len(model.model_fields) - len(DEFAULTS.get(kind, {})) for kind, model in EVENT_TYPES.items()}
