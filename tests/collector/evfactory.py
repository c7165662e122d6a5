"""Event factories for the collector tests (plain dicts, as they travel on the wire)."""

from __future__ import annotations

import json
from typing import Any

T0 = 1_760_000_000.0
# A collector takes pushes only within its raw retention; these events are from 2025-10, so the
# collectors the tests push them to keep raw events this long.
REPLAY_RETENTION_DAYS = 3650.0


def request(i: int = 0, **kw: Any) -> dict[str, Any]:
    ev = {
        "type": "request",
        "v": 1,
        "instance": "e0",
        "run_id": "r1",
        "ts": T0 + i,
        "request_id": f"q{i}",
        "status": "finished",
        "prompt_tokens": 100,
        "output_tokens": 11,
        "queue_s": 0.01,
        "prefill_s": 0.02,
        "ttft_s": 0.03,
        "decode_s": 0.5,
        "e2e_s": 0.55,
    }
    ev.update(kw)
    return ev


def step(i: int = 0, **kw: Any) -> dict[str, Any]:
    ev = {
        "type": "step",
        "instance": "e0",
        "run_id": "r1",
        "ts": T0 + i,
        "step": i,
        "duration_s": 0.01,
        "forward_s": 0.008,
        "num_seqs": 4,
        "prefill_tokens": 64,
        "decode_tokens": 4,
        "kv_blocks_used": 10,
        "kv_blocks_total": 100,
        "queue_depth": 2,
        "busy_s": 0.009,
    }
    ev.update(kw)
    return ev


def alloc(i: int = 0, **kw: Any) -> dict[str, Any]:
    ev = {
        "type": "alloc",
        "instance": "e0",
        "run_id": "r1",
        "ts": T0 + i,
        "op": "alloc",
        "request_id": f"q{i}",
        "blocks": 2,
        "block_size": 32,
        "bytes": 65536,
        "usage_after": 0.25,
    }
    ev.update(kw)
    return ev


def sample(i: int = 0, **kw: Any) -> dict[str, Any]:
    ev = {
        "type": "sample",
        "instance": "e0",
        "run_id": "r1",
        "ts": T0 + i,
        "utilization": 0.5,
        "memory_used_bytes": 4 * 2**30,
        "memory_total_bytes": 16 * 2**30,
        "kv_usage": 0.4,
        "fragmentation": 0.1,
        "internal_waste": 0.05,
        "queue_depth": 3,
    }
    ev.update(kw)
    return ev


def mixed(n: int, start: int = 0, **kw: Any) -> list[dict[str, Any]]:
    makers = (request, step, alloc, sample)
    return [makers[i % 4](start + i, **kw) for i in range(n)]


def body(events: list[dict[str, Any]], key: str | None = None) -> bytes:
    payload: dict[str, Any] = {"events": events}
    if key is not None:
        payload["idempotency_key"] = key
    return json.dumps(payload).encode()


def gap(i: int = 0, **kw: Any) -> dict[str, Any]:
    ev = {
        "type": "gap",
        "instance": "e0",
        "run_id": "r1",
        "ts": T0 + i,
        "kind": "request",
        "reason": "spool_full",
        "events": 10,
        "first_ts": T0 + i - 60,
        "last_ts": T0 + i - 1,
    }
    ev.update(kw)
    return ev
