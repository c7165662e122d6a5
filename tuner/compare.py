"""A live comparison that beats the noise: the candidate against the running config, each on its own server,
both up, the idle one paused while the other serves, measured in ABBA order, pairs added until the interval says.

On a shared machine one measurement of a config swings by tens of percent from minute to minute, more than most
config changes are worth. Three things take that out of the answer:
- both servers are up for the whole comparison (no restart in between) and the idle one is paused, so neither
  competes with the other for the CPU and each sees the machine as it is at that minute;
- a pair is four measurements A B B A (A the running config, B the candidate) on one held-out seed, its log
  capacity ratio the mean of the two halves' (log B1/A1 + log B2/A2) / 2: a drift of the machine's speed that is
  linear over the pair cancels;
- pairs are added (one held-out seed after another) until the 90% interval of the mean log ratio (Student's t
  over the pairs) says something, or the pair budget ends.

Verdict (`verdict`): `proposal` when the whole interval of the ratio is above 1 and it is not all inside the
equivalence margin (its upper end past 1 + `margin`); `no gain` when it is below 1, or inside 1 ± `margin` (the
configs are equivalent to within what is worth a restart); otherwise `inconclusive`, said as such with the
interval. A measurement whose SLOs still held at the
largest rate its search tried is a lower bound, not a capacity (a workload too short to load the server: compressed
far enough it is one batch), and one that failed at every rate its short budget reached is no capacity either: a
ratio of such figures proves nothing (counted as equal they would narrow the interval toward "no gain"), so such a
pair makes the comparison `inconclusive`, said as "capacity not found", and ends it at the minimum of pairs. A
measurement that could not be made at all (its first replay sent late on every attempt: `NotMeasuredError`) voids
its pair and ends the comparison `inconclusive`, with the reason (`not_measured`), never a crash of the caller.
The A/A check is the same protocol with the running config on both servers: it must not say `proposal`.

Server instances are randomized too (`renew`): every round starts on fresh servers of every side. Two servers of
one config differ by several percent for as long as they run (the bench's A/A checks on servers kept for the whole
comparison read -0.2%, +1.3%, -0.2%, -2.2% and +8.1%); a difference that stays with an instance is in every pair
of a comparison kept on the same servers, so the pairs agree and the interval narrows around it (run 17: +8.1%,
90% interval +2.4%..+14.0% for the running config against itself). With fresh servers per round, each pair draws
its own instances, the instance spread is in the spread of the pairs, and the interval covers it.
`compare_arms` runs several comparisons against one running config in shared rounds, each arm's pair nested
inside the others' (A B A' A' B A for the candidate B and the A/A check's second server A'): every arm's two
measurements sit symmetrically about the round's middle, so a linear drift still cancels in each, and the
running config is measured twice a round rather than twice per arm.

Each measurement is a capacity (`tuner.capacity`), read as its estimate (`Capacity.estimate`: where the SLO pressure
crosses 1 within the bracket): the bracket's lower end moves in whole steps, and with 15% steps an A/A pair read 0
or +-14% and never the few percent an equivalence needs. A held-out seed's traffic is not the tuning seed's, and its
capacity can sit well away from the running config's known one: the first measurement of a seed (A1 of its first
pair) is a scout, a search of `scout_replays` from the known capacity that brackets it (doubling or halving first,
then bisecting). The pair's other three start at the scout's answer, every later one at its side's last answer on
that seed; each is a short search that stops at its first bracket one `step` wide: 2 replays, more
(up to `max_replays`) when the answer moved by more than a step; its answer is the estimate within it. A full
search for all four would cost 5-8 replays each, a quarter of an hour per pair on a CPU vLLM. (The first bench
runs had neither: short searches started at the tuning seed's capacity failed at every rate they reached on a
heavier held-out seed, and a fixed budget of 2 replays that held twice ended unbracketed.)
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine import workload as W
from tuner.backends import NotMeasuredError
from tuner.capacity import MAX_MULTIPLIER, MIN_MULTIPLIER, Capacity, Replayer, replay_capacity
from tuner.metrics import SLO

log = logging.getLogger("kvpilot.tuner.compare")

LEVEL = 0.90
# two-sided 90% Student t quantiles (the 95th percentile) by degrees of freedom (pairs - 1)
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}
_T95_LARGE = 1.645
MAX_PAIRS = 10
DEFAULT_MARGIN = 0.03  # capacity ratios within 1 +- this are "no gain": not worth a restart
SCOUT_GROWTH = 2.0  # a scout's steps until it brackets (a held-out seed's capacity may be half the tuning seed's)
PROPOSAL, NO_GAIN, INCONCLUSIVE = "proposal", "no gain", "inconclusive"


class Side(Protocol):
    """One server of one config: measured on a seed starting at a multiplier, paused and resumed around it."""

    label: str

    def capacity(self, *, seed: int, start: float, tag: str, scout: bool = False) -> Capacity: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


@dataclass(frozen=True)
class Interval:
    ratio: float  # the geometric mean capacity ratio (candidate / running) over the pairs
    low: float
    high: float
    pairs: int

    def as_dict(self) -> dict[str, float | int]:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "pairs": self.pairs}


def interval(log_ratios: Sequence[float], *, level: float = LEVEL) -> Interval:
    """The `level` interval of the capacity ratio from paired log ratios: exp(mean +- t * sd / sqrt(n))."""
    if level != LEVEL:
        raise ValueError(f"level: only {LEVEL} is tabulated, got {level}")
    n = len(log_ratios)
    if n == 0:
        raise ValueError("interval: no pairs")
    mean = statistics.fmean(log_ratios)
    if n < 2:
        return Interval(math.exp(mean), 0.0, math.inf, n)
    half = _T95.get(n - 1, _T95_LARGE) * statistics.stdev(log_ratios) / math.sqrt(n)
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)


def verdict(iv: Interval, *, margin: float) -> str:
    """`proposal`, `no gain` or `inconclusive` for an interval of the ratio (module docstring)."""
    if iv.high < 1.0 or (iv.low >= 1.0 / (1.0 + margin) and iv.high <= 1.0 + margin):
        return NO_GAIN
    if iv.low > 1.0 and iv.high > 1.0 + margin:
        return PROPOSAL
    return INCONCLUSIVE


def pair_log_ratio(a1: float, b1: float, b2: float, a2: float, *, floor: float) -> float:
    """The mean of the AB and BA halves' log ratios; a capacity of 0 counts as `floor` (no log of 0)."""
    a1, b1, b2, a2 = (max(x, floor) for x in (a1, b1, b2, a2))
    return (math.log(b1 / a1) + math.log(b2 / a2)) / 2.0


@dataclass
class Comparison:
    running: str
    candidate: str
    margin: float
    seeds: list[int]
    pairs: list[dict[str, Any]] = field(default_factory=list)
    interval: Interval | None = None
    verdict: str = INCONCLUSIVE
    lower_bounds: list[float] = field(default_factory=list)  # figures (req/s) of searches that found no capacity
    unsent: list[str] = field(default_factory=list)  # of those, why a scout past them was not measured (the sender)
    not_measured: str | None = None  # why a measurement could not be made (its first replay sent late every time)
    fresh_servers: bool = False  # every pair on fresh server instances (`compare_arms`'s `renew`)

    @property
    def gain(self) -> float:
        return self.interval.ratio - 1.0 if self.interval else 0.0

    @property
    def gain_low(self) -> float:
        return self.interval.low - 1.0 if self.interval else -1.0

    @property
    def gain_high(self) -> float:
        return self.interval.high - 1.0 if self.interval else math.inf

    def mean_capacity(self, side: str) -> float:
        """Mean capacity (requests/s) of `side` ('running' or 'candidate') over every measurement."""
        values = [c for p in self.pairs for c in p[side]]
        return statistics.fmean(values) if values else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The comparison as a proposal records it (`best_metrics["confirmation"]`, every engine alike)."""
        return {
            "objective": "slo_capacity",
            "running": self.running,
            "candidate": self.candidate,
            "seeds": self.seeds,
            "verdict": self.verdict,
            "holds": self.verdict == PROPOSAL,
            "sentence": self.sentence(),
            "gain": self.gain,
            "gain_low": self.gain_low,
            "gain_high": self.gain_high,
            "interval": self.interval.as_dict() if self.interval else None,
            "margin": self.margin,
            "level": LEVEL,
            "capacity_not_found_rps": self.lower_bounds,
            "unsent": self.unsent,
            "not_measured": self.not_measured,
            "fresh_servers": self.fresh_servers,
            "running_capacity_rps": self.mean_capacity("running"),
            "candidate_capacity_rps": self.mean_capacity("candidate"),
            "pairs": self.pairs,
        }

    def sentence(self) -> str:
        """What the comparison says, with its interval."""
        if self.not_measured is not None:
            return f"inconclusive: a measurement could not be made ({self.not_measured}); no verdict from the rest"
        if self.interval is None:
            return "not measured"
        if self.unsent:
            return (
                "inconclusive: capacity not found: the SLOs held at the largest rate measured and the next one could"
                f" not be sent on time ({self.unsent[0]}): no ratio"
            )
        if self.lower_bounds:
            return (
                "inconclusive: capacity not found within a search's budget (the SLOs held at the largest rate tried, or"
                " failed at every rate tried): no ratio; replay a longer workload or give the search more replays"
            )
        iv = self.interval
        if iv.pairs < 2:
            return f"{self.gain:+.1%} capacity in the first ABBA pair (an interval needs two)"
        fresh = ", each on fresh servers" if self.fresh_servers else ""
        span = f"90% interval {iv.low - 1:+.1%}..{iv.high - 1:+.1%}, {iv.pairs} ABBA pairs{fresh}"
        if self.verdict == PROPOSAL:
            return f"serves {self.gain:+.1%} traffic at the same SLOs ({span})"
        if self.verdict == NO_GAIN:
            return f"no gain: {self.gain:+.1%} capacity ({span}; equivalence margin +-{self.margin:.0%})"
        return f"inconclusive: {self.gain:+.1%} capacity ({span}); the pair budget ended first"


def compare(running: Side, candidate: Side, **options: Any) -> Comparison:
    """ABBA pairs on the held-out seeds in turn (module docstring): `compare_arms` with one arm, and its options
    (`seeds`, `start`: the multiplier each seed's scout starts at, e.g. the running config's known capacity; the
    rest start at the scout's answer, then at their side's last)."""
    (out,) = compare_arms(running, [candidate], **options)
    return out


def compare_arms(
    running: Side,
    arms: Sequence[Side],
    *,
    seeds: Sequence[int],
    start: float,
    min_pairs: int = 2,
    max_pairs: int = 4,
    margin: float = DEFAULT_MARGIN,
    floor_rps: float,
    renew: Callable[[int], None] | None = None,
    say: Callable[[str], None] = lambda message: None,
) -> list[Comparison]:
    """Several comparisons against one running config in shared rounds, one `Comparison` per arm. A round on a
    seed nests the arms' pairs around the running config's two measurements: A X1 X2 X2 X1 A for arms X1 and X2
    (A B B A for one), so every arm's two measurements sit symmetrically about the round's middle, as A's do, and
    a drift linear over the round cancels in each arm's ratio; the running config is measured twice per round
    instead of twice per arm (the A/A check's arm, a second server of the running config, costs 2 measurements
    a round, not 4). An arm whose comparison has said (at least `min_pairs` pairs) leaves the later rounds. Arms
    need labels of their own (each side's warm start is kept by label). `renew(i)`, when given, puts fresh servers
    under every side before round `i` (every side paused; paused again after): each pair on instances of its
    own (module docstring)."""
    if not 2 <= min_pairs <= max_pairs <= MAX_PAIRS:
        raise ValueError(f"pairs: need 2 <= min_pairs <= max_pairs <= {MAX_PAIRS}, got {min_pairs}, {max_pairs}")
    if not seeds:
        raise ValueError("seeds: at least one held-out seed")
    if not arms or len({running.label, *(a.label for a in arms)}) != len(arms) + 1:
        raise ValueError(f"arms: at least one, each labelled apart from the others and from {running.label!r}")
    outs = [Comparison(running.label, arm.label, margin, list(seeds), fresh_servers=renew is not None) for arm in arms]
    done = [False] * len(arms)

    def who(k: int) -> str:
        return f"{arms[k].label}: " if len(arms) > 1 else ""

    priors: dict[int, dict[str, float]] = {}  # per seed: each side's last answer (the scout's at first)
    for side in (running, *arms):
        side.pause()
    try:
        for i in range(max_pairs):
            live = [k for k in range(len(arms)) if not done[k]]
            if not live:
                break
            seed = seeds[i % len(seeds)]
            scout = seed not in priors
            prior = priors.setdefault(seed, {side.label: start for side in (running, *arms)})
            order = [*live, *reversed(live)]  # X1 X2 .. X2 X1 between A1 and A2
            try:
                if renew is not None:
                    renew(i)
                    for side in (running, *arms):
                        side.pause()
                a1 = _measure(running, seed, prior, f"p{i}-0", scout=scout)
                if scout and a1.multiplier > 0:
                    for k in live:
                        prior[arms[k].label] = a1.multiplier
                measured: dict[int, list[Capacity]] = {k: [] for k in live}
                for n, k in enumerate(order, start=1):
                    measured[k].append(_measure(arms[k], seed, prior, f"p{i}-{n}"))
                a2 = _measure(running, seed, prior, f"p{i}-{len(order) + 1}")
            except NotMeasuredError as exc:  # the sender's limit, not a config's: the round is void, and so is the rest
                for k in live:
                    outs[k].not_measured = f"pair {i + 1}, seed {seed}: {exc.reason}"
                    outs[k].verdict = INCONCLUSIVE
                    say(f"{who(k)}pair {i + 1} (seed {seed}): {outs[k].sentence()}")
                break
            for k in live:
                b1, b2 = measured[k]
                done[k] = _add_pair(outs[k], seed, (a1, b1, b2, a2), floor_rps=floor_rps, min_pairs=min_pairs)
                rps = ", ".join(f"{c.estimate_rps:.2f}" for c in (a1, b1, b2, a2))
                say(f"{who(k)}pair {i + 1} (seed {seed}): capacities {rps} req/s; {outs[k].sentence()}")
    finally:
        for side in (running, *arms):
            side.resume()
    return outs


def _add_pair(
    out: Comparison, seed: int, caps: tuple[Capacity, Capacity, Capacity, Capacity], *, floor_rps: float, min_pairs: int
) -> bool:
    """One ABBA pair (A1 B1 B2 A2) into `out`, its interval and verdict updated; True when the comparison has
    said: past the minimum of pairs, a verdict, or a capacity not found (more pairs of this workload cannot find
    it)."""
    a1, b1, b2, a2 = caps
    rps = [c.estimate_rps for c in caps]
    open_ended = [c.capacity_rps for c in caps if not c.found]
    out.pairs.append(
        {
            "seed": seed,
            "running": [a1.estimate_rps, a2.estimate_rps],
            "candidate": [b1.estimate_rps, b2.estimate_rps],
            "held": [c.capacity_rps for c in caps],  # each bracket's lower end, A B B A
            "replays": sum(len(c.probes) for c in caps),
            "bracketed": not open_ended,
            "log_ratio": pair_log_ratio(*rps, floor=floor_rps),
        }
    )
    out.interval = interval([p["log_ratio"] for p in out.pairs])
    out.verdict = verdict(out.interval, margin=out.margin) if len(out.pairs) >= 2 else INCONCLUSIVE
    out.lower_bounds.extend(open_ended)
    out.unsent.extend(f"seed {seed}: {c.not_measured}" for c in caps if not c.found and c.not_measured)
    if out.lower_bounds:
        out.verdict = INCONCLUSIVE
    return len(out.pairs) >= min_pairs and (bool(out.lower_bounds) or out.verdict != INCONCLUSIVE)


def _measure(side: Side, seed: int, prior: dict[str, float], tag: str, *, scout: bool = False) -> Capacity:
    """One capacity of `side` with the other paused: resumed for it, paused after, warm-started at its last. A
    short search that ended without a capacity (the SLOs held at every rate it reached, or failed at every one)
    goes on as a scout from past its last rate: a candidate with twice the running config's capacity is out of a
    short search's reach from the running config's answer. The answer's `probes` hold both searches' replays; a
    scout whose first rate the sender cannot send on time leaves the short search's answer (a bound, `not_measured`
    saying why)."""
    side.resume()
    try:
        cap = side.capacity(seed=seed, start=prior[side.label], tag=tag, scout=scout)
        if not scout and not cap.found and cap.not_measured is None and cap.probes:
            tried = [p.multiplier for p in cap.probes]
            restart = cap.multiplier * SCOUT_GROWTH if cap.multiplier > 0 else min(tried) / SCOUT_GROWTH
            if MIN_MULTIPLIER <= restart <= MAX_MULTIPLIER:
                try:
                    scouted = side.capacity(seed=seed, start=restart, tag=f"{tag}s", scout=True)
                except NotMeasuredError as exc:  # a rate past what the sender sends on time: the short one stands
                    cap.not_measured = f"x{restart:.4g}: {exc.reason}"
                else:
                    scouted.probes[:0] = cap.probes
                    cap = scouted
    finally:
        side.pause()
    if cap.multiplier > 0:
        prior[side.label] = cap.multiplier
    return cap


@dataclass
class ReplayerSide:
    """A `Side` on any `tuner.capacity.Replayer`: the held-out seed's requests from `requests(seed)`, a short
    search of `max_replays` around the prior in steps of `step` (a scout: `scout_replays`), pausing through the
    given callables."""

    label: str
    backend: Replayer
    config: Any
    requests: Callable[[int], tuple[list[W.WorkloadRequest], list[list[int]]]]
    slo: SLO
    name: str
    step: float = 1.15
    rel_tol: float = 0.05  # a scout's
    max_replays: int = 4  # a short search's bound: it stops earlier, at its first bracket
    scout_replays: int = 6
    on_pause: Callable[[], None] = lambda: None
    on_resume: Callable[[], None] = lambda: None
    measured: list[Capacity] = field(default_factory=list)

    def capacity(self, *, seed: int, start: float, tag: str, scout: bool = False) -> Capacity:
        reqs, prompts = self.requests(seed)
        cap = replay_capacity(
            self.backend,
            self.config,
            reqs,
            prompts,
            slo=self.slo,
            run_id=f"{self.name}-{self.label}-s{seed}-{tag}",
            start=max(start, MIN_MULTIPLIER),
            growth=SCOUT_GROWTH if scout else self.step,
            # a short search stops at its first bracket one step wide (usually 2 replays); a scout bisects on
            rel_tol=self.rel_tol if scout else self.step - 1 + 1e-9,
            max_replays=self.scout_replays if scout else self.max_replays,
        )
        self.measured.append(cap)
        return cap

    def pause(self) -> None:
        self.on_pause()

    def resume(self) -> None:
        self.on_resume()
