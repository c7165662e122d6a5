"""Measure the target's capacity for `sustained`: a closed-loop probe keeps `concurrency` requests of the
scenario's own length mix in flight for `probe_s` and counts answered requests per second. Sustained
load then arrives open-loop at `share` (0.8 in the seed) of that rate."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import httpx

from kvpilot.loadtest.client import ClientOptions, send
from kvpilot.loadtest.plan import PlannedRequest
from kvpilot.loadtest.prompts import fetch_token_pool


@dataclass(frozen=True, slots=True)
class Capacity:
    requests_per_s: float
    answered: int
    refused: int
    failed: int
    probe_s: float
    concurrency: int

    def as_dict(self) -> dict:
        return {
            "requests_per_s": round(self.requests_per_s, 3),
            "answered": self.answered,
            "refused": self.refused,
            "failed": self.failed,
            "probe_s": round(self.probe_s, 3),
            "concurrency": self.concurrency,
        }


async def measure_capacity(
    base_url: str, shapes: list[PlannedRequest], opts: ClientOptions, *, probe_s: float, concurrency: int
) -> Capacity:
    if not shapes:
        raise ValueError("capacity probe needs request shapes")
    base_url = base_url.rstrip("/")
    counts = {"ok": 0, "refused": 0, "other": 0}
    next_shape = 0
    probe_opts = replace(opts, run_id=f"{opts.run_id}-capacity")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(opts.timeout_s)) as client:
        if opts.api == "openai" and opts.token_pool is None:  # the probe's prompts as long as the run's
            pool, _ = await fetch_token_pool(client, base_url, shapes, model=opts.model, seed=opts.seed)
            probe_opts = replace(probe_opts, token_pool=pool)
        t0 = time.perf_counter()
        deadline = t0 + probe_s

        async def worker() -> None:
            nonlocal next_shape
            while time.perf_counter() < deadline:
                shape = shapes[next_shape % len(shapes)]
                req = PlannedRequest(next_shape, 0.0, shape.prompt_tokens, shape.max_tokens, shape.kind)
                next_shape += 1
                res = await send(client, base_url, req, probe_opts, t0=t0)
                key = res.outcome if res.outcome in ("ok", "refused") else "other"
                counts[key] += 1
                if res.outcome == "refused":
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return Capacity(counts["ok"] / elapsed, counts["ok"], counts["refused"], counts["other"], elapsed, concurrency)
