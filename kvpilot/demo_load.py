"""The demo's traffic: open-loop mixed load on the engine's /generate with a +500% burst in the middle."""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from collections.abc import Callable

import httpx

from engine import workload as W


def _text(tokens: int, rng: random.Random) -> str:
    """ASCII text of `tokens - 1` bytes: the byte tokenizer adds BOS, so it is `tokens` tokens."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(max(1, tokens - 1)))


async def drive_demo_load(
    url: str, *, duration_s: float, stop: threading.Event, say: Callable[[str], None], base_rate: float = 5.0
) -> dict:
    burst_at = duration_s * 0.35
    plan = W.burst(
        duration_s,
        base_rate=base_rate,
        burst_at_s=burst_at,
        burst_len_s=2.0,
        factor=6.0,
        seed=7,
        scale=3,
        output_range=(64, 256),
    )
    rng = random.Random(3)
    say(f"load: {len(plan)} requests over {duration_s:.0f} s, burst of +500% at t={burst_at:.0f} s")
    results: list[dict] = []
    refused = 0
    errors = 0

    async def one(client: httpx.AsyncClient, req: W.WorkloadRequest) -> None:
        nonlocal refused, errors
        body = {
            "prompt": _text(req.prompt_tokens, rng),
            "max_tokens": req.output_tokens,
            "ignore_eos": True,
            "priority": ("high", "normal", "low")[req.priority],
        }
        try:
            r = await client.post(f"{url}/generate", json=body, timeout=120)
        except httpx.HTTPError:
            errors += 1
            return
        if r.status_code == 429:
            refused += 1
        elif r.status_code == 200:
            results.append(r.json())
        else:
            errors += 1

    t0 = time.monotonic()
    last_report = 0.0
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=512)) as client:
        tasks = []
        for req in plan:
            if stop.is_set():
                break
            delay = req.arrival_s - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, req)))
            now = time.monotonic() - t0
            if now - last_report >= 5:
                last_report = now
                say(f"load: t={now:4.0f} s sent {len(tasks)} answered {len(results)} refused {refused}")
        pending = [t for t in tasks if not t.done()]
        if pending:
            say(f"load: waiting for {len(pending)} requests in flight")
            await asyncio.gather(*pending)
    wall = time.monotonic() - t0
    e2e = sorted(r["timings"]["e2e_s"] for r in results) or [0.0]
    ttft = [r["timings"]["ttft_s"] for r in results if r["timings"]["ttft_s"] is not None] or [0.0]
    tokens = sum(r["output_tokens"] for r in results)
    return {
        "sent": len(tasks),
        "answered": len(results),
        "refused": refused,
        "errors": errors,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "p50_s": statistics.median(e2e),
        "p99_s": e2e[min(len(e2e) - 1, round(0.99 * (len(e2e) - 1)))],
        "ttft_p50_s": statistics.median(ttft),
    }
