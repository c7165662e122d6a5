"""What an OTLP export will cost to decode, counted on its bytes before it is decoded.

The protobuf runtime builds every message of a body before anyone can count them: 32 KiB of gzip holding
16.8 million empty spans took 3 GB, and one span with 8 million empty attributes 415 MB. So the wire
format is walked first (tag, wire type, length; nothing built): every submessage the runtime would
build is counted, spans apart, and the walk stops at the first bound passed. Which fields are messages
comes from the protocol package's own descriptors, so a field the package adds is counted too.

OTLP/JSON is bounded the same way before `json.loads` (`wirescan.json_values_bound`), and its spans are
counted on the decoded dicts before the slow protobuf mapping runs.

Bounds, per export of at most `max_spans` spans: MESSAGES_PER_SPAN submessages and FIELDS_PER_SPAN wire
fields per span on average (a vLLM `llm_request` span has 28 and 61), JSON_VALUES_PER_SPAN JSON
values (83 by `json_values_bound`), each plus a constant for the resource and scope around them.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from collector.wirescan import json_values_bound

MESSAGES_PER_SPAN = 64
FIELDS_PER_SPAN = 256
JSON_VALUES_PER_SPAN = 128
SLACK = 4096
MAX_DEPTH = 100  # the protobuf runtime's own recursion limit

_SPAN = Span.DESCRIPTOR
_LEN = 2


class ExportBoundError(ValueError):
    """More spans, messages, fields or JSON values than an export of `max_spans` spans may hold."""


class MalformedError(ValueError):
    """Not a protobuf message (truncated, bad wire type, too deep)."""


@functools.cache
def _children(desc: Descriptor) -> dict[int, Descriptor]:
    """Field number -> message type, for the message-typed fields of `desc`."""
    return {
        f.number: f.message_type
        for f in desc.fields
        if f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type is not None
    }


class _Budget:
    __slots__ = ("fields", "max_spans", "messages", "spans")

    def __init__(self, max_spans: int) -> None:
        self.max_spans = max_spans
        self.spans = max_spans
        self.messages = MESSAGES_PER_SPAN * max_spans + SLACK
        self.fields = FIELDS_PER_SPAN * max_spans + SLACK


def count_protobuf(body: bytes, *, max_spans: int) -> int:
    """The spans in an ExportTraceServiceRequest; ExportBoundError past a bound, MalformedError if it is
    not one. Time and memory: at most the field budget's worth of steps, nothing built."""
    budget = _Budget(max_spans)
    try:
        _walk(body, 0, len(body), ExportTraceServiceRequest.DESCRIPTOR, budget, 0)
    except IndexError:
        raise MalformedError("truncated") from None
    return max_spans - budget.spans


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise MalformedError("varint too long")


def _walk(data: bytes, pos: int, end: int, desc: Descriptor, budget: _Budget, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise MalformedError("nested too deep")
    children = _children(desc)
    while pos < end:
        budget.fields -= 1
        if budget.fields < 0:
            raise ExportBoundError(f"export has more wire fields than {budget.max_spans} spans may hold")
        tag = data[pos]
        pos += 1
        if tag >= 0x80:
            tag, pos = _varint(data, pos - 1)
        wire = tag & 7
        if wire == 0:
            while data[pos] >= 0x80:
                pos += 1
            pos += 1
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == _LEN:
            size, pos = _varint(data, pos)
            stop = pos + size
            if stop > end:
                raise MalformedError("length past the end")
            child = children.get(tag >> 3)
            if child is not None:
                budget.messages -= 1
                if budget.messages < 0:
                    raise ExportBoundError(f"export has more messages than {budget.max_spans} spans may hold")
                if child is _SPAN:
                    budget.spans -= 1
                    if budget.spans < 0:
                        limit = budget.max_spans
                        raise ExportBoundError(f"export has more than {limit} spans; the limit is {limit}")
                if _children(child):
                    _walk(data, pos, stop, child, budget, depth + 1)
            pos = stop
        else:
            raise MalformedError(f"wire type {wire}")
    if pos != end:
        raise MalformedError("field past the end")


def check_json_size(body: bytes, *, max_spans: int) -> None:
    """ExportBoundError if the JSON document may hold more values than `max_spans` spans need."""
    if json_values_bound(body) > JSON_VALUES_PER_SPAN * max_spans + SLACK:
        raise ExportBoundError(f"export has more JSON values than {max_spans} spans may hold")


def count_json_spans(data: dict[str, Any], items: Any) -> int:
    """The spans of a decoded OTLP/JSON export; `items(obj, *names)` lists a repeated field as otlp reads it."""
    return sum(
        len(items(scope, "spans"))
        for resource in items(data, "resourceSpans", "resource_spans")
        for scope in items(resource, "scopeSpans", "scope_spans")
    )
