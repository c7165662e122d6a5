"""Did the client send the plan: on time, and at the planned lengths?

An open-loop load test measures the target under the plan's arrivals only while the client keeps to them.
A client whose event loop is busy (parsing many streams on a loaded machine) sends late, the target sees
other arrivals than planned (gaps, then bunches), and its latency figures describe that other load. So the
client measures its own lateness (when it began sending each request against the plan) and a run whose p99
lateness is over `LATENESS_LIMIT_S` says that its figures do not count (the `client_on_time` criterion
fails). A 50 ms limit is a fraction of any TTFT worth measuring and far above the scheduling noise of an idle
asyncio loop.

Token counts compare the plan with the server's own counts (`usage`), so a tokenizer that does not make the
planned prompt lengths, or a server that stops early, shows here instead of in the latency figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.loadtest.client import RequestResult
from plumbing.openloop import Lateness

LATENESS_LIMIT_S = 0.050


def lateness(late: Lateness) -> dict:
    """The client's sending lateness (summarised by `plumbing.openloop.lateness`), and whether it held."""
    return {
        "count": late.count,
        "p50_s": _r(late.p50_s),
        "p99_s": _r(late.p99_s),
        "max_s": _r(late.max_s),
        "limit_s": LATENESS_LIMIT_S,
        "on_time": late.p99_s is not None and late.p99_s <= LATENESS_LIMIT_S,
    }


def verdict(late: dict) -> str:
    if late["on_time"]:
        return (
            f"the client sent on time (p99 {1000 * late['p99_s']:.1f} ms late, limit {1000 * LATENESS_LIMIT_S:.0f} ms)"
        )
    if late["p99_s"] is None:
        return "nothing was sent"
    return (
        f"figures do not count: the client sent p99 {1000 * late['p99_s']:.1f} ms late (max "
        f"{1000 * late['max_s']:.1f} ms, limit {1000 * LATENESS_LIMIT_S:.0f} ms), so the target saw other "
        "arrivals than planned; run the client on a less loaded machine or lower --rate"
    )


def tokens(results: Sequence[RequestResult], prompt_form: str) -> dict:
    """Planned against served prompt and output tokens of the answered requests."""
    ok = [r for r in results if r.outcome == "ok"]
    served_prompt = [r.served_prompt_tokens for r in ok if r.served_prompt_tokens is not None]
    counted = sum(r.server_counted for r in ok)
    return {
        "prompt_form": prompt_form,
        "prompt_planned": sum(r.prompt_tokens for r in ok),
        "prompt_served": sum(served_prompt) if ok and len(served_prompt) == len(ok) else None,
        "output_planned": sum(r.max_tokens for r in ok),
        "output_served": sum(r.output_tokens for r in ok),
        "output_counted_by": "server" if counted == len(ok) else "client chunks" if counted == 0 else "mixed",
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
