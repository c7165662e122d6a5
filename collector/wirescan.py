"""Bounds on a JSON body's structure, found on its bytes before anything builds Python objects from it.

A decoder's memory follows the number of values it builds, and pydantic's also the errors it collects
(each holds its input): 2 MB of `{"type":"request"}` events once made a million errors and 1.8 GB, and
length limits on lists are checked after the whole list was built. So a body is measured first, at C
speed and without materialising it:
- `split_batch`: an ingest batch's events, found one by one (an event is a flat JSON object of scalars,
  so a regular expression finds where each ends) and counted as they are found: past `max_events` the
  batch is refused before one event is validated, and each event is then validated alone;
- `json_values_bound`: an upper bound on the number of values in any JSON document, for decoders that
  cannot be fed one piece at a time (OTLP/JSON).
"""

from __future__ import annotations

import re

import msgspec

# A JSON string, possessively: linear however it is nested or cut short.
_STRING = rb'"(?:[^"\\]++|\\.)*+"'
_STRINGS = re.compile(_STRING)
# One element of the events array: a flat object (no array or object inside), then `,` or `]`.
_FLAT_EVENT = re.compile(rb'\s*+(\{(?:[^{}\[\]"]++|' + _STRING + rb")*+\})\s*+([,\]])")
_EMPTY_ARRAY = re.compile(rb"\[\s*+\]")
# Strings of the wire schema are at most 200 characters; written as \uXXXX surrogate pairs that is 2,400
# bytes each, so a real event stays far below this.
MAX_EVENT_BYTES = 16 * 1024
MAX_KEY_BYTES = 4096


class BatchShapeError(ValueError):
    """The body is not `{"events": [flat objects...], "idempotency_key": ...}`; `loc` names where."""

    def __init__(self, loc: str, msg: str) -> None:
        super().__init__(f"{loc}: {msg}")
        self.loc = loc
        self.msg = msg


class TooManyEventsError(ValueError):
    """More than `max_events` events: found while counting, before any was decoded."""


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    events: msgspec.Raw
    idempotency_key: msgspec.Raw = msgspec.Raw(b"null")


_ENVELOPE = msgspec.json.Decoder(_Envelope)


def split_batch(body: bytes, *, max_events: int) -> tuple[bytes, list[bytes]]:
    """(the idempotency key's JSON, each event's JSON) of an ingest batch, at most `max_events` of them.

    Raises TooManyEventsError as soon as event `max_events + 1` is found, BatchShapeError for anything
    that is not a batch of flat objects (malformed JSON, an unknown top-level key, a nested value, an
    event over MAX_EVENT_BYTES). Memory: the events found so far, each at most MAX_EVENT_BYTES.
    """
    try:
        envelope = _ENVELOPE.decode(body)  # msgspec.Raw skips the events without building them
    except msgspec.ValidationError as exc:
        raise BatchShapeError("(body)", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise BatchShapeError("(body)", f"Invalid JSON: {exc}") from None
    except RecursionError:
        raise BatchShapeError("(body)", "nested too deep") from None
    key = bytes(envelope.idempotency_key)
    if len(key) > MAX_KEY_BYTES:
        raise BatchShapeError("idempotency_key", f"longer than {MAX_KEY_BYTES} bytes")
    array = bytes(envelope.events)
    if not array.startswith(b"["):
        raise BatchShapeError("events", "Input should be a valid list")
    if _EMPTY_ARRAY.fullmatch(array):
        return key, []
    events: list[bytes] = []
    pos = 1
    while True:
        match = _FLAT_EVENT.match(array, pos)
        if match is None:
            raise BatchShapeError(f"events[{len(events)}]", "each event must be a JSON object of scalar fields")
        start, end = match.span(1)
        if end - start > MAX_EVENT_BYTES:
            raise BatchShapeError(f"events[{len(events)}]", f"event larger than {MAX_EVENT_BYTES} bytes")
        events.append(array[start:end])
        if len(events) > max_events:
            raise TooManyEventsError(f"batch has more than {max_events} events; the limit is {max_events}")
        if match.group(2) == b"]":
            return key, events
        pos = match.end()


def json_values_bound(body: bytes) -> int:
    """An upper bound on the values (scalars, arrays, objects; not keys) in the JSON document `body`.

    Outside strings, every value but the root follows a `[` (an array's first element), a `,` (a later
    element, or a member: at most one per `:`) or a `:` (a member's value). So values <= 1 + the count of
    those three outside strings. Computed on a copy with every string emptied: two C-speed passes.
    """
    bare = _STRINGS.sub(b'""', body)
    return 1 + bare.count(b"[") + bare.count(b",") + bare.count(b":")
