"""A bundle: several engines' pushes in one POST, each keeping its own Idempotency-Key and its own answer.

A fleet's collectors pay twice for every push: once per event (parse, validate, COPY) and once per
request (HTTP, authentication, admission, a turn at the storage stage). At 1,000 engines flushing every
second the second cost is a thousand requests a second, which two cores cannot serve; engines then push
less often and their data ages. A node relay (`collector.relay`) collects its node's pushes over
loopback and forwards them as one bundle; the collector stores every member exactly as if it had come
alone (its key, its digest of the bytes the engine sent, its validation, its outcome) in one storage round.

The wire form (`MEDIA_TYPE`, gzip allowed as Content-Encoding) is a sequence of members, each a header
line and the engine's body verbatim, so nothing is parsed twice and the digest is of the engine's bytes::

    {"key": "engine-7-1234", "length": 48213}\\n<48213 bytes: the engine's JSON event batch>
    {"key": null, "length": 311}\\n<311 bytes>

`key` null: the member had no Idempotency-Key (the collector makes one, as for a lone push).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

MEDIA_TYPE = "application/x-kvpilot-bundle"
PATH = "/v1/ingest/bundle"
MAX_HEADER_BYTES = 512
KEY_PATTERN = re.compile(r"[!-~]{1,200}")  # the Idempotency-Key header's own bound


class BundleError(ValueError):
    """A bundle that cannot be split into its members; nothing of it is stored."""


@dataclass(frozen=True)
class Member:
    key: str | None
    body: bytes


def encode(members: Sequence[Member]) -> bytes:
    parts = []
    for m in members:
        if m.key is not None and not KEY_PATTERN.fullmatch(m.key):
            raise BundleError(f"key {m.key!r} is not 1-200 printable ASCII characters")
        parts.append(json.dumps({"key": m.key, "length": len(m.body)}).encode() + b"\n")
        parts.append(m.body)
    return b"".join(parts)


def decode(data: bytes, *, max_members: int) -> list[Member]:
    """The members of `data`, in order; `BundleError` naming the member and what is wrong with it."""
    members: list[Member] = []
    at = 0
    while at < len(data):
        n = len(members)
        if n == max_members:
            raise BundleError(f"more than {max_members} members")
        end = data.find(b"\n", at, at + MAX_HEADER_BYTES)
        if end < 0:
            raise BundleError(f"member {n}: no header line within {MAX_HEADER_BYTES} bytes")
        try:
            header = json.loads(data[at:end])
        except ValueError:
            raise BundleError(f"member {n}: the header is not JSON") from None
        if not isinstance(header, dict) or set(header) != {"key", "length"}:
            raise BundleError(f"member {n}: the header must be an object of exactly 'key' and 'length'")
        key, length = header["key"], header["length"]
        if key is not None and not (isinstance(key, str) and KEY_PATTERN.fullmatch(key)):
            raise BundleError(f"member {n}: key must be null or 1-200 printable ASCII characters")
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise BundleError(f"member {n}: length must be a non-negative integer")
        start = end + 1
        if start + length > len(data):
            raise BundleError(f"member {n}: {length} bytes announced, {len(data) - start} left")
        members.append(Member(key, data[start : start + length]))
        at = start + length
    if not members:
        raise BundleError("no members")
    return members
