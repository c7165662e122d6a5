"""What a load test sends and when: one `PlannedRequest` per request, arrival times relative to the start.

Scenarios follow the seed: `mixed` (30% short, 60% medium, 10% long prompts, Poisson arrivals), `burst`
(the same mix with +500% load for 2 s in the middle of the run), `sustained` (Poisson at a fixed share of
measured capacity) and `trace` (replay of an Azure LLM inference trace). Plans are deterministic for a
seed, so two runs of one command send the same requests at the same offsets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine import workload
from plumbing.lengths import clip_lengths

SCENARIOS = ("mixed", "burst", "sustained", "trace")
_LETTERS = "abcdefghijklmnopqrstuvwxyz     "


class PlanError(ValueError):
    """A scenario that cannot be planned; `option` names the CLI option at fault."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    kind: str = "medium"


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Shape of the synthetic scenarios. `length_scale`/`output_scale` divide the seed's token counts so
    the same mix fits a small model; `max_total_tokens` clips prompt + output to the target's context."""

    duration_s: float
    rate: float
    seed: int = 0
    length_scale: float = 1.0
    output_range: tuple[int, int] = (32, 512)
    output_scale: float = 1.0
    max_total_tokens: int | None = None
    burst_factor: float = 6.0
    burst_len_s: float = 2.0


def prompt_text(tokens: int, index: int, seed: int = 0) -> str:
    """ASCII text that the byte-level tokenizer encodes as exactly `tokens` tokens (BOS included)."""
    rng = random.Random((seed << 24) ^ (index * 2654435761))
    body = "".join(rng.choice(_LETTERS) for _ in range(max(1, tokens - 1)))
    return "q" + body[1:] if body[0] == " " else body


def _from_workload(reqs: list[workload.WorkloadRequest], opts: PlanOptions) -> list[PlannedRequest]:
    out = []
    for i, r in enumerate(reqs):
        prompt, output = clip_lengths(r.prompt_tokens, r.output_tokens, opts.max_total_tokens)
        out.append(PlannedRequest(i, r.arrival_s, prompt, output, r.kind))
    return out


def _mix_kwargs(opts: PlanOptions) -> dict:
    return {"scale": opts.length_scale, "output_range": opts.output_range, "output_scale": opts.output_scale}


def plan_mixed(opts: PlanOptions) -> list[PlannedRequest]:
    """Poisson arrivals at `rate` for `duration_s` with the 30/60/10 length mix."""
    _check(opts)
    n = int(opts.duration_s * opts.rate * 2) + 16
    reqs = [
        r
        for r in workload.mixed(n, seed=opts.seed, rate=opts.rate, **_mix_kwargs(opts))
        if r.arrival_s < opts.duration_s
    ]
    return _from_workload(reqs, opts)


def plan_burst(opts: PlanOptions) -> list[PlannedRequest]:
    """Base `rate`, rising by `burst_factor` (6x = +500%) for `burst_len_s` in the middle of the run, so the
    first and last windows both see the base load and P99 drift measures recovery."""
    _check(opts)
    if opts.burst_len_s >= opts.duration_s / 2:
        raise PlanError("--duration", f"a burst of {opts.burst_len_s}s needs a run of more than twice that")
    at = (opts.duration_s - opts.burst_len_s) / 2
    reqs = workload.burst(
        opts.duration_s,
        base_rate=opts.rate,
        burst_at_s=at,
        burst_len_s=opts.burst_len_s,
        factor=opts.burst_factor,
        seed=opts.seed,
        **_mix_kwargs(opts),
    )
    return _from_workload(reqs, opts)


def plan_sustained(opts: PlanOptions) -> list[PlannedRequest]:
    """Steady Poisson load at `rate` (the caller sets it to a share of measured capacity)."""
    return plan_mixed(opts)


def burst_window(opts: PlanOptions) -> tuple[float, float]:
    at = (opts.duration_s - opts.burst_len_s) / 2
    return at, at + opts.burst_len_s


def _check(opts: PlanOptions) -> None:
    if not opts.duration_s > 0:
        raise PlanError("--duration", f"must be positive, got {opts.duration_s}")
    if not opts.rate > 0:
        raise PlanError("--rate", f"must be positive, got {opts.rate}")
    if not opts.length_scale > 0:
        raise PlanError("--length-scale", f"must be positive, got {opts.length_scale}")
    if not opts.output_scale > 0:
        raise PlanError("--output-scale", f"must be positive, got {opts.output_scale}")
