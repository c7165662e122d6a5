"""SLO capacity: the largest multiple of a workload's arrival rate at which a config still meets its SLOs.

Goodput at one fixed rate cannot rank configs that all keep up with that rate (every one serves all of it), and
at a rate past everyone's capacity it swings with the queue's chaos. Capacity asks what an operator buys: how
much more of *this* traffic one server of the config takes before its users see the SLOs break. The SLOs are
read from the request rows as the collector stored them (`tuner.metrics.trial_metrics`: p99 TTFT as users see
it, p99 TPOT) and at least `MIN_FINISHED` of the requests must finish.

The traffic at `m` times its rate (`at_rate`) lasts as long as the recorded traffic: past x1 the recording is
time-compressed by `m` and repeated back to back until its own span is filled (bursts kept, `m` times as many
requests), each repeat's prompts made distinct so that no repeat hits the prefix cache another one filled;
under x1 it is thinned evenly. Compressing alone (the first version) shortened the replay with the rate: a
40-request recording at x32 was one batch of 40 that any config absorbed within the SLOs, so the search never
found a limit. At a rate the server cannot keep up with for the whole span, the queue grows and the SLOs fail,
as they would in production.

`search` is a bracketing search on one running server (no restart between its replays): the multiplier grows
geometrically from `start` while the SLOs hold (or shrinks while they fail) until one probe holds and another fails,
then the bracket is bisected geometrically until its ends are within `rel_tol` of each other, all within
`max_replays` replays. The capacity is the largest multiplier that held, in requests/s the multiplier times the
workload's own rate. Within the bracket the SLOs break somewhere; `Capacity.estimate` places it where the SLO
pressure (`pressure`: the most-stretched SLO's figure over its limit, 1 at the edge) crosses 1, interpolated in
log-log between the two ends. A comparison's ratios read the estimate: the lower end alone moves in whole steps (two
configs 5% apart read equal, or one step apart), a quantization that no number of pairs averages away. The search
stops unbracketed past `MAX_MULTIPLIER` or when a replay would exceed `MAX_REPLAY_REQUESTS`: the capacity is then at
least what held. A replay that could not be measured (its sender late on every attempt: a rate past what the client
sends on time here) ends the search with what it has and says why (`not_measured`); only the first replay's failure
is the caller's. `near` measures a config whose capacity is likely close to a known one (another config's on the
same traffic): steps of `NEAR_STEP` from there until the first bracket one step wide, usually 2 replays, and a
wide search from past its last rate only when those steps did not bracket it. Any backend that can replay a request
list on a config serves (`Replayer`): the vLLM backend (`tuner.vllm.backend`), a live kvpilot engine
(`tuner.live`), and the simulators (`tuner.backends`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine import workload as W
from tuner.backends import NotMeasuredError
from tuner.metrics import SLO, TrialMetrics

log = logging.getLogger("kvpilot.tuner.capacity")

MIN_FINISHED = 0.99  # share of the replayed requests that must finish
MAX_REPLAYS = 20  # one search's bound: each replay lasts the workload's span (plus the queue's drain)
MIN_MULTIPLIER = 1 / 64  # below this the config serves (almost) none of the traffic: capacity 0
MAX_MULTIPLIER = 256.0  # the search's ceiling ("at least" past it)
MAX_REPLAY_REQUESTS = 20_000  # a replay's size bound: a search that would send more stops there ("at least")
NEAR_STEP = 1.15  # `near`'s step: its bracket is this wide, the estimate placed within it
NEAR_GROWTH = 2.0  # `near`'s wide search when its steps did not bracket (a capacity twice or half the known one)
PROMPT_VOCAB = 256  # prompt bodies are byte tokens (`engine.workload.prompt_ids`); repeats shift them within it


class Replayer(Protocol):
    """A backend that replays a request list (with its prompts' token ids) on a config and reads the metrics back."""

    def measure_requests(
        self, config: Any, reqs: list[W.WorkloadRequest], prompts: list[list[int]], *, run_id: str
    ) -> TrialMetrics: ...


@dataclass(frozen=True)
class Probe:
    multiplier: float
    holds: bool
    breaches: tuple[str, ...]  # which SLOs failed, with the figures
    metrics: TrialMetrics
    pressure: float | None = None  # `pressure(metrics, slo)`: <= 1 where the SLOs hold


@dataclass
class Capacity:
    """One search's answer: `multiplier` (0 when no probe held) and the probes that led to it, in order."""

    rate_rps: float  # the workload's own arrival rate
    multiplier: float = 0.0
    upper: float | None = None  # the smallest multiplier that failed (None: never bracketed from above)
    probes: list[Probe] = field(default_factory=list)
    not_measured: str | None = None  # why the search stopped early: a replay its sender could not send on time

    @property
    def capacity_rps(self) -> float:
        return self.multiplier * self.rate_rps

    @property
    def estimate(self) -> float:
        """The multiplier where the SLOs break (module docstring): the SLO pressure's crossing of 1, interpolated in
        log-log between the bracket's ends and kept within them; `multiplier` when not bracketed or a pressure is
        unknown (an end that served nothing: no figure to interpolate)."""
        if not self.bracketed:
            return self.multiplier
        assert self.upper is not None
        low = _pressure_at(self.probes, self.multiplier)
        high = _pressure_at(self.probes, self.upper)
        if low is None or high is None or not 0 < low <= 1 < high < math.inf:
            return self.multiplier
        share = -math.log(low) / (math.log(high) - math.log(low))
        return math.exp(math.log(self.multiplier) + share * (math.log(self.upper) - math.log(self.multiplier)))

    @property
    def estimate_rps(self) -> float:
        return self.estimate * self.rate_rps

    @property
    def warm_start(self) -> float:
        """Where a later search of the same traffic starts: the multiplier that held, 1 when none did."""
        return self.multiplier if self.multiplier > 0 else 1.0

    @property
    def bracketed(self) -> bool:
        return self.multiplier > 0 and self.upper is not None

    @property
    def found(self) -> bool:
        """A capacity, not a bound: bracketed, or 0 because the smallest multiplier failed. Not found: the SLOs
        still held at the largest multiplier tried (a lower bound), or failed at every one tried above the
        smallest (the search's budget ended first)."""
        if self.multiplier > 0:
            return self.upper is not None
        return any(not p.holds and p.multiplier <= MIN_MULTIPLIER for p in self.probes)

    @property
    def goodput_at_rate_tps(self) -> float | None:
        """Goodput at the recorded rate (multiplier 1), when the search probed it."""
        return next((p.metrics.goodput_tps for p in self.probes if p.multiplier == 1.0), None)

    def summary(self) -> dict[str, Any]:
        return {
            "capacity_rps": round(self.capacity_rps, 4),
            "estimate_rps": round(self.estimate_rps, 4),
            "multiplier": round(self.multiplier, 4),
            "upper": None if self.upper is None else round(self.upper, 4),
            "rate_rps": round(self.rate_rps, 4),
            "goodput_at_rate_tps": self.goodput_at_rate_tps,
            "replays": len(self.probes),
            "not_measured": self.not_measured,
            "probes": [
                {
                    "multiplier": round(p.multiplier, 4),
                    "holds": p.holds,
                    "pressure": None if p.pressure is None else round(p.pressure, 4),
                    "breaches": list(p.breaches),
                }
                for p in self.probes
            ],
        }


def breaches(m: TrialMetrics, slo: SLO) -> tuple[str, ...]:
    """The SLOs `m` misses: p99 TTFT (user-facing) over its limit, p99 TPOT over the TPOT SLO, too few finished."""
    ttft_limit = slo.p99_ttft_limit_s
    out = []
    if m.ttft_p99_s is None or m.ttft_p99_s > ttft_limit:
        held = f" ({m.held_back} requests waited for a connection to the server first)" if m.held_back else ""
        out.append(f"p99 TTFT {_s(m.ttft_p99_s)} > {ttft_limit:g} s{held}")
    if m.tpot_p99_s is not None and m.tpot_p99_s > slo.tpot_s:
        out.append(f"p99 TPOT {_s(m.tpot_p99_s)} > {slo.tpot_s:g} s")
    if m.requests == 0 or m.finished < MIN_FINISHED * m.requests:
        out.append(f"{m.finished}/{m.requests} finished < {MIN_FINISHED:.0%}")
    return tuple(out)


def pressure(m: TrialMetrics, slo: SLO) -> float:
    """How far `m` is stretched against its SLOs: the largest of p99 TTFT over its limit, p99 TPOT over the TPOT
    SLO and the unfinished share over the share allowed (1 - `MIN_FINISHED`); above 1 exactly where `breaches`
    names one, infinite when nothing was served."""
    ttft_limit = slo.p99_ttft_limit_s
    if m.ttft_p99_s is None or m.requests == 0:
        return math.inf
    figures = [m.ttft_p99_s / ttft_limit, (1.0 - m.finished / m.requests) / (1.0 - MIN_FINISHED)]
    if m.tpot_p99_s is not None:
        figures.append(m.tpot_p99_s / slo.tpot_s)
    return max(figures)


def _pressure_at(probes: Sequence[Probe], multiplier: float) -> float | None:
    """The pressure of the last probe at `multiplier` (a search continued by another measures a rate again)."""
    return next((p.pressure for p in reversed(probes) if p.multiplier == multiplier), None)


def _s(v: float | None) -> str:
    return "none" if v is None else f"{v:.3g} s"


def arrival_rate(reqs: Sequence[W.WorkloadRequest]) -> float:
    """Requests/s of the workload as recorded: its requests over the span of its arrivals."""
    if len(reqs) < 2:
        raise ValueError(f"capacity: a workload of {len(reqs)} request(s) has no arrival rate")
    arrivals = [r.arrival_s for r in reqs]
    span = max(arrivals) - min(arrivals)
    if span <= 0:
        raise ValueError("capacity: every request arrives at once (an offline batch has no arrival rate)")
    return (len(reqs) - 1) / span


def at_rate(
    reqs: Sequence[W.WorkloadRequest], prompts: Sequence[list[int]], multiplier: float
) -> tuple[list[W.WorkloadRequest], list[list[int]]]:
    """The workload at `multiplier` times its arrival rate over its own span, and each request's prompt (module
    docstring): repeats of the compressed recording past x1, each repeat's prompts distinct; thinned under x1."""
    if len(prompts) != len(reqs):
        raise ValueError(f"at_rate: {len(reqs)} requests but {len(prompts)} prompts")
    picks = _at_rate_picks(reqs, multiplier)
    return _repeats(reqs, picks), [_distinct_prompt(prompts[i], k) for i, _, k in picks]


def at_rate_requests(reqs: Sequence[W.WorkloadRequest], multiplier: float) -> list[W.WorkloadRequest]:
    """`at_rate` for a backend that makes the prompts itself from the requests (the simulators): each repeat's
    prefix groups renumbered, so that its prompts share prefixes within the repeat, not with another."""
    return _repeats(reqs, _at_rate_picks(reqs, multiplier))


def requests_at(reqs: Sequence[W.WorkloadRequest], multiplier: float) -> int:
    """How many requests the replay at `multiplier` sends (what `MAX_REPLAY_REQUESTS` bounds)."""
    return len(_at_rate_picks(reqs, multiplier))


def _at_rate_picks(reqs: Sequence[W.WorkloadRequest], multiplier: float) -> list[tuple[int, float, int]]:
    """(index into `reqs`, arrival, repeat) of every request the replay at `multiplier` sends, in arrival order."""
    if not multiplier > 0:
        raise ValueError(f"multiplier: must be positive, got {multiplier}")
    if not reqs:
        return []
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    if multiplier <= 1:  # thinned: every request whose running share crosses a whole one, arrivals kept
        kept = [i for n, i in enumerate(order) if math.floor((n + 1) * multiplier) > math.floor(n * multiplier)]
        return [(i, reqs[i].arrival_s, 0) for i in (kept or order[:1])]
    # the first arrival stays where the recording has it (a replay's window opens before its first request);
    # the recording's period is its span plus one mean gap, so that repeats back to back keep the rate even
    t0 = reqs[order[0]].arrival_s
    period = arrival_rate_period(reqs)
    span = period / multiplier
    out = []
    for k in range(math.ceil(multiplier)):
        for i in order:
            offset = (reqs[i].arrival_s - t0) / multiplier + k * span
            if offset < period:
                out.append((i, t0 + offset, k))
    return out


def arrival_rate_period(reqs: Sequence[W.WorkloadRequest]) -> float:
    """The time one pass of the workload stands for at its own rate: its requests over `arrival_rate`."""
    return len(reqs) / arrival_rate(reqs)


def _repeats(reqs: Sequence[W.WorkloadRequest], picks: list[tuple[int, float, int]]) -> list[W.WorkloadRequest]:
    """The picked requests at their new arrivals, repeat k's prefix groups moved past every group of the ones
    before it."""
    stride = 1 + max((r.prefix_group or 0 for r in reqs), default=0)
    return [
        dataclasses.replace(
            reqs[i], arrival_s=arrival, prefix_group=None if (g := reqs[i].prefix_group) is None else g + k * stride
        )
        for i, arrival, k in picks
    ]


def _distinct_prompt(prompt: list[int], k: int) -> list[int]:
    """Repeat `k`'s copy of `prompt`: the first body tokens shifted by `k`'s digits in the prompt vocabulary (the
    first token, BOS, kept), so repeats share no prefix-cache block while one repeat's prefix groups still do."""
    if k == 0:
        return prompt
    out = list(prompt)
    pos = 1
    while k and pos < len(out):
        k, digit = divmod(k, PROMPT_VOCAB)
        out[pos] = (out[pos] + digit) % PROMPT_VOCAB if out[pos] < PROMPT_VOCAB else out[pos]
        pos += 1
    return out


def search(
    measure: Callable[[float], TrialMetrics],
    *,
    rate_rps: float,
    slo: SLO,
    start: float = 1.0,
    growth: float = 2.0,
    rel_tol: float = 0.05,
    max_replays: int = 8,
    too_big: Callable[[float], bool] | None = None,
) -> Capacity:
    """The bracketing search (module docstring); `measure(multiplier)` replays the workload at that multiple of
    its rate; `too_big(multiplier)` says a replay would be past the size bound (the search stops growing)."""
    if not 1 <= max_replays <= MAX_REPLAYS:
        raise ValueError(f"max_replays: must be within 1..{MAX_REPLAYS}, got {max_replays}")
    if not growth > 1 or not rel_tol > 0 or not start > 0 or not rate_rps > 0:
        raise ValueError("capacity search: growth > 1, rel_tol > 0, start > 0 and a positive rate")
    out = Capacity(rate_rps=rate_rps)
    low: float | None = None  # the largest multiplier that held
    m = start
    while len(out.probes) < max_replays:
        try:
            metrics = measure(m)
        except NotMeasuredError as exc:  # the sender, not the server, could not keep up with this rate
            if not out.probes:
                raise
            out.not_measured = f"x{m:.4g}: {exc.reason}"
            break
        missed = breaches(metrics, slo)
        out.probes.append(Probe(m, not missed, missed, metrics, pressure(metrics, slo)))
        log.info("x%.4g (%.3g req/s): %s", m, m * rate_rps, "; ".join(missed) if missed else "the SLOs hold")
        if not missed:
            low = m if low is None else max(low, m)
        else:
            out.upper = m if out.upper is None else min(out.upper, m)
        if low is not None and out.upper is not None:
            if out.upper / low <= 1 + rel_tol:
                break
            m = math.sqrt(low * out.upper)
        elif low is not None:
            m = low * growth
            if m > MAX_MULTIPLIER or (too_big is not None and too_big(m)):
                break
        else:
            m = m / growth
            if m < MIN_MULTIPLIER:
                break
    out.multiplier = low or 0.0
    return out


def near(
    measure: Callable[[float, str], TrialMetrics],
    *,
    rate_rps: float,
    slo: SLO,
    start: float,
    max_replays: int = 4,
    wide_replays: int = 6,
    too_big: Callable[[float], bool] | None = None,
) -> Capacity:
    """A capacity close to `start` (module docstring): `measure(multiplier, tag)` replays at that multiple, the tag
    saying which search ("" or "-w"). A wide search whose first replay cannot be sent on time leaves the short
    search's answer, a bound that says why (`not_measured`)."""
    start = max(start, MIN_MULTIPLIER)
    short = search(
        lambda m: measure(m, ""),
        rate_rps=rate_rps,
        slo=slo,
        start=start,
        growth=NEAR_STEP,
        rel_tol=NEAR_STEP - 1 + 1e-9,  # the first bracket one step wide ends it
        max_replays=max_replays,
        too_big=too_big,
    )
    if short.found or short.not_measured is not None or not short.probes:
        return short
    lowest = min(p.multiplier for p in short.probes)
    restart = short.multiplier * NEAR_GROWTH if short.multiplier > 0 else lowest / NEAR_GROWTH
    if not MIN_MULTIPLIER <= restart <= MAX_MULTIPLIER or (too_big is not None and too_big(restart)):
        return short
    try:
        wide = search(
            lambda m: measure(m, "-w"),
            rate_rps=rate_rps,
            slo=slo,
            start=restart,
            growth=NEAR_GROWTH,
            max_replays=wide_replays,
            too_big=too_big,
        )
    except NotMeasuredError as exc:  # a rate past what the sender sends on time: the short search's bound stands
        short.not_measured = f"x{restart:.4g}: {exc.reason}"
        return short
    wide.probes[:0] = short.probes
    return wide


def replay_capacity(
    backend: Replayer,
    config: Any,
    reqs: list[W.WorkloadRequest],
    prompts: list[list[int]],
    *,
    slo: SLO,
    run_id: str,
    start: float = 1.0,
    growth: float = 2.0,
    rel_tol: float = 0.05,
    max_replays: int = 8,
) -> Capacity:
    """`config`'s capacity on `backend` for the workload `reqs` (its rate: `arrival_rate`), one server throughout."""
    return search(
        _replayer(backend, config, reqs, prompts, run_id),
        rate_rps=arrival_rate(reqs),
        slo=slo,
        start=start,
        growth=growth,
        rel_tol=rel_tol,
        max_replays=max_replays,
        too_big=lambda m: requests_at(reqs, m) > MAX_REPLAY_REQUESTS,
    )


def replay_capacity_near(
    backend: Replayer,
    config: Any,
    reqs: list[W.WorkloadRequest],
    prompts: list[list[int]],
    *,
    slo: SLO,
    run_id: str,
    start: float,
    max_replays: int = 4,
    wide_replays: int = 6,
) -> Capacity:
    """`near` on `backend`: `config`'s capacity for `reqs`, close to the multiplier `start` (another config's)."""
    return near(
        _replayer(backend, config, reqs, prompts, run_id),
        rate_rps=arrival_rate(reqs),
        slo=slo,
        start=start,
        max_replays=max_replays,
        wide_replays=wide_replays,
        too_big=lambda m: requests_at(reqs, m) > MAX_REPLAY_REQUESTS,
    )


def _replayer(
    backend: Replayer, config: Any, reqs: list[W.WorkloadRequest], prompts: list[list[int]], run_id: str
) -> Callable[..., TrialMetrics]:
    """`measure(multiplier, tag="")`: the workload at that multiple of its rate on `config`'s server."""

    def measure(multiplier: float, tag: str = "") -> TrialMetrics:
        scaled, scaled_prompts = at_rate(reqs, prompts, multiplier)
        return backend.measure_requests(config, scaled, scaled_prompts, run_id=f"{run_id}{tag}-x{multiplier:.4g}")

    return measure
