"""The demo's traffic: open-loop mixed load (`plumbing.openloop`) on the engine's /generate with a +500% burst
in the middle.

The burst lasts until the alert it is there to show has fired (`BurstGate`), not a fixed two seconds:
KV memory must stay over 90% for the rule's `for`, and how long the burst needs for that depends on the
machine. A bound keeps a machine that never gets there from bursting forever; the demo then says why.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from engine import workload as W
from plumbing.openloop import open_loop
from plumbing.percentile import nearest_rank

BURST_FACTOR = 6.0  # +500%


def _text(tokens: int, rng: random.Random) -> str:
    """ASCII text of `tokens - 1` bytes: the byte tokenizer adds BOS, so it is `tokens` tokens."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(max(1, tokens - 1)))


@dataclass
class BurstGate:
    """Whether the burst is on at load time `t`: from `start_s` until `done()` says its purpose is met
    (checked once `min_s` have passed), and never longer than `max_s`."""

    start_s: float
    min_s: float
    max_s: float
    done: Callable[[], bool]
    ended_s: float | None = None
    outcome: str = "not started"

    def active(self, t: float) -> bool:
        if t < self.start_s or self.ended_s is not None:
            return False
        held = t - self.start_s
        if held >= self.min_s and self.done():
            self.ended_s, self.outcome = t, "the alert fired"
        elif held >= self.max_s:
            self.ended_s, self.outcome = t, f"its bound of {self.max_s:g} s passed without the alert firing"
        else:
            self.outcome = "on"
        return self.ended_s is None

    @property
    def length_s(self) -> float | None:
        return None if self.ended_s is None else self.ended_s - self.start_s


def arrivals(
    gate: BurstGate, *, duration_s: float, base_rate: float, seed: int = 7, now: Callable[[], float]
) -> Iterator[tuple[float, W.WorkloadRequest]]:
    """(arrival offset, request shape) pairs: Poisson at `base_rate`, at `BURST_FACTOR` times that while
    the gate is open. Arrivals stop at `duration_s`, or when the burst ends if it is still on then.
    `now()` is the load's clock: the gate is asked at the time of asking, not at a planned time."""
    rng = random.Random(seed + 1)
    # Prompts at 1/6 of the seed's mix and outputs of 64-256 tokens: sequences that grow while they run keep
    # KV memory full under a queue; long prompts at the head of the queue would make it dip below 90% while
    # they wait for room, and the rule's `for` starts over at every dip.
    shapes = W.mixed(4096, seed=seed, scale=6, output_range=(64, 256))
    t = 0.0
    for i in range(len(shapes)):
        bursting = gate.active(max(t, now()))
        t += rng.expovariate(base_rate * (BURST_FACTOR if bursting else 1.0))
        if t >= duration_s and not gate.active(max(t, now())):
            return
        yield t, shapes[i]


async def drive_demo_load(
    url: str,
    *,
    duration_s: float,
    stop: threading.Event,
    say: Callable[[str], None],
    base_rate: float = 2.0,
    burst_done: Callable[[], bool] = lambda: False,
    burst_max_s: float = 60.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict:
    """Send the load, burst until `burst_done()` (at most `burst_max_s`); the figures of what was answered."""
    gate = BurstGate(start_s=duration_s * 0.35, min_s=2.0, max_s=burst_max_s, done=burst_done)
    rng = random.Random(3)
    say(
        f"load: {base_rate:g} requests/s for {duration_s:.0f} s; a +500% burst from t={gate.start_s:.0f} s "
        f"until MemoryPressure fires (at most {burst_max_s:g} s)"
    )
    results: list[dict] = []
    refused = 0
    errors = 0
    shapes: list[W.WorkloadRequest] = []  # by request index, as the arrivals come

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

    t0 = time.perf_counter()
    last_report = 0.0
    burst_said = False

    def say_burst_ended() -> None:
        nonlocal burst_said
        if gate.ended_s is not None and not burst_said:
            burst_said = True
            say(f"load: burst ended at t={gate.ended_s:.1f} s after {gate.length_s:.1f} s: {gate.outcome}")

    def offsets() -> Iterator[float]:
        """The arrivals as the load goes (the gate asks whether the alert fired yet), until they end or `stop`;
        the progress is said as each request has started (the loop asks for the next arrival then)."""
        nonlocal last_report
        for arrival_s, req in arrivals(
            gate, duration_s=duration_s, base_rate=base_rate, now=lambda: time.perf_counter() - t0
        ):
            if stop.is_set():
                break
            shapes.append(req)
            yield arrival_s
            now = time.perf_counter() - t0
            say_burst_ended()
            if now - last_report >= 5:
                last_report = now
                say(f"load: t={now:4.0f} s sent {len(shapes)} answered {len(results)} refused {refused}")
        say_burst_ended()
        if in_flight := len(shapes) - len(results) - refused - errors:
            say(f"load: waiting for {in_flight} requests in flight")

    limits = httpx.Limits(max_connections=512)
    async with httpx.AsyncClient(limits=limits, transport=transport) as client:
        await open_loop(offsets(), lambda i: one(client, shapes[i]), t0=t0)
    wall = time.perf_counter() - t0
    e2e = [r["timings"]["e2e_s"] for r in results] or [0.0]
    ttft = [r["timings"]["ttft_s"] for r in results if r["timings"]["ttft_s"] is not None] or [0.0]
    tokens = sum(r["output_tokens"] for r in results)
    return {
        "sent": len(shapes),
        "answered": len(results),
        "refused": refused,
        "errors": errors,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "p50_s": nearest_rank(e2e, 0.5),
        "p99_s": nearest_rank(e2e, 0.99),
        "ttft_p50_s": nearest_rank(ttft, 0.5),
        "burst_start_s": gate.start_s,
        "burst_s": gate.length_s,
        "burst_outcome": gate.outcome,
        "weights": results[0].get("weights") if results else None,
        "wall_s": wall,
    }
