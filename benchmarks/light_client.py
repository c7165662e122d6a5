"""A light load client for one vLLM: a trace of bursts on shared prefixes, sent over raw sockets.

Light so that its own lag stays out of what it measures on a busy host: each request's bytes are prepared
before the replay and its connection opened a second ahead (uvicorn keeps an idle one 5 s), so at send time
the client writes once; reading is a byte search for the first chunk with completion text and for
`data: [DONE]`. Each request carries `X-Request-Id`, which vLLM names it (and its span) after.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from plumbing.openloop import open_loop

WORDS = ["cache", "block", "queue", "token", "batch", "prefill", "decode", "step", "engine", "memory", "request"]


@dataclass(frozen=True)
class TraceRequest:
    at_s: float  # offset from the replay's start
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class ClientTiming:
    request_id: str  # sent as X-Request-Id: vLLM names the request (and its span) after it
    sent: float  # wall clock, seconds
    ttft_s: float | None
    e2e_s: float
    ok: bool


def shared_prefix_trace(
    *, bursts: int, burst_size: int, gap_s: float, prefixes: int = 4, prefix_words: int = 120, seed: int = 0
) -> list[TraceRequest]:
    """Bursts of `burst_size` arrivals within 50 ms, `gap_s` apart; prompts are one of `prefixes` long shared
    prefixes (a system prompt) plus a question of their own, outputs 8-32 tokens."""
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(prefixes)]
    out = []
    for b in range(bursts):
        for i in range(burst_size):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
            out.append(
                TraceRequest(
                    at_s=b * gap_s + rng.uniform(0.0, 0.05),
                    prompt=f"{rng.choice(heads)}\nquestion {b}-{i}: {question}",
                    max_tokens=rng.randint(8, 32),
                )
            )
    return sorted(out, key=lambda r: r.at_s)


OPEN_AHEAD_S = 1.0  # each request's connection is opened this long before it is sent (uvicorn keeps 5 s)
TEXT = b'"text":"'


def _request_bytes(host: str, port: int, model: str, req: TraceRequest, request_id: str) -> bytes:
    body = json.dumps(
        {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nX-Request-Id: {request_id}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _has_text(buf: bytearray, pos: int) -> bool:
    """A completion chunk with text in `buf` from `pos` on (`"text":"` followed by anything but its end)."""
    i = buf.find(TEXT, pos)
    while i >= 0:
        if buf[i + len(TEXT) : i + len(TEXT) + 1] not in (b'"', b""):
            return True
        i = buf.find(TEXT, i + 1)
    return False


async def _one(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes, request_id: str
) -> ClientTiming:
    """One streamed completion on its own connection, the bytes prepared beforehand: the client's work at
    send time is one socket write, and reading is a byte search, so its own lag stays small."""
    sent, start = time.time(), time.perf_counter()
    writer.write(data)
    buf, ttft, ok = bytearray(), None, False
    try:
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            pos = max(0, len(buf) - 16)
            buf += chunk
            if ttft is None and _has_text(buf, pos):
                ttft = time.perf_counter() - start
            if b"data: [DONE]" in buf[pos:]:
                ok = buf.startswith(b"HTTP/1.1 200")
                break
    except OSError:
        ok = False
    finally:
        writer.close()
    return ClientTiming(request_id, sent, ttft, time.perf_counter() - start, ok and ttft is not None)


async def replay(url: str, model: str, trace: list[TraceRequest], tag: str) -> list[ClientTiming]:
    """Send every request at its offset (`plumbing.openloop`), streaming, each on a connection opened
    `OPEN_AHEAD_S` before it."""
    parsed = httpx.URL(url)
    host, port = parsed.host, parsed.port or 80
    prepared = [_request_bytes(host, port, model, r, f"{tag}-{i}") for i, r in enumerate(trace)]
    conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def connect(i: int) -> None:
        conns[i] = await asyncio.open_connection(host, port)

    async def send(i: int) -> ClientTiming:
        return await _one(*conns.pop(i), prepared[i], f"{tag}-{i}")

    t0 = time.perf_counter() + OPEN_AHEAD_S + 0.1
    fired = await open_loop([r.at_s for r in trace], send, t0=t0, prepare=connect, lead_s=OPEN_AHEAD_S)
    return fired.results
