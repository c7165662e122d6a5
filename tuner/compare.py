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
margin (its upper end past 1 + `margin`); `no gain` when its upper end is within 1 + `margin`: whatever the
candidate buys, it is not the `margin` a restart is worth (a one-sided test against the margin; a candidate that
may be worse is no gain either); otherwise `inconclusive`, said as such with the interval: it may gain more than
the margin and may gain nothing. A measurement whose SLOs still held at the
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
`compare_arms` runs several comparisons against one running config in shared rounds, each side's two measurements
nested inside the others' (A B A' A' B A for the candidate B and the A/A check's second server A'): every side's
two sit symmetrically about the round's middle, so a linear drift still cancels in each, and the running config
is measured twice a round rather than twice per arm. Which depth of the nesting a side is measured at is not
neutral on this machine: the A/A arm, innermost (A' above), read -1.7% over bench run 20's four rounds and -6.7%,
-8.9% in run 21's two, as if a second server of one config were 7% slower; in `bench vllm-placement`'s isolated A B
B A rounds B read -3.2% and -1.3%. So the sides take turns (`rotation`: B A' A A A' B in the next round, A' A B B A
A' in the third): over as many rounds as sides each is measured once at every depth, and an effect of the depth
(or of whatever else comes with a side's place in the round) cancels over the rounds as a linear drift cancels
within one.

Each measurement is a capacity (`tuner.capacity`), read as its estimate (`Capacity.estimate`: where the SLO pressure
crosses 1 within the bracket): the bracket's lower end moves in whole steps, and with 15% steps an A/A pair read 0
or +-14% and never the few percent an equivalence needs. Each is a short search that stops at its first bracket
one step (15%) wide: 2 replays, more (up to `max_replays`) when the answer moved by more than a step; its answer is
the estimate within it (`tuner.capacity.near`). The first measurement of a seed (A1 of its first pair) starts at
the running config's known capacity, the pair's other three at A1's answer, every later one at its side's last
answer on that seed. A held-out
seed's traffic is not the tuning seed's, and its capacity can sit well away from the known one: a short search
that ends without a bracket goes on as a scout, a search of `scout_replays` from past its last rate (doubling or
halving first, then bisecting). (The first bench runs had no scout: short searches started at the tuning seed's
capacity failed at every rate they reached on a heavier held-out seed. Later every seed's first measurement was a
scout, 6 replays where a short search takes 2 when the seed's capacity is near the known one; a full search for
all four would cost 5-8 replays each, a quarter of an hour per pair.)
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from engine import workload as W
from tuner.backends import NotMeasuredError
from tuner.capacity import Capacity, Replayer, replay_capacity_near
from tuner.metrics import SLO

log = logging.getLogger("kvpilot.tuner.compare")

LEVEL = 0.90
# two-sided 90% Student t quantiles (the 95th percentile) by degrees of freedom (pairs - 1)
_T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}
_T95_LARGE = 1.645
MAX_PAIRS = 10
DEFAULT_MARGIN = 0.03  # capacity ratios within 1 +- this are "no gain": not worth a restart
PROPOSAL, NO_GAIN, INCONCLUSIVE = "proposal", "no gain", "inconclusive"
T = TypeVar("T")


class Side(Protocol):
    """One server of one config: measured on a seed starting at a multiplier, paused and resumed around it."""

    label: str

    def capacity(self, *, seed: int, start: float, tag: str) -> Capacity: ...

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
    if iv.high <= 1.0 + margin:
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
    budget_ended: bool = False  # inconclusive when the pair budget ran out

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
            return f"no gain: {self.gain:+.1%} capacity ({span}: under the {self.margin:.0%} a restart is worth)"
        ended = "; the pair budget ended first" if self.budget_ended else ""
        return f"inconclusive: {self.gain:+.1%} capacity ({span}){ended}"


def compare(running: Side, candidate: Side, **options: Any) -> Comparison:
    """ABBA pairs on the held-out seeds in turn (module docstring): `compare_arms` with one arm, and its options
    (`seeds`, `start`: the multiplier each seed's first measurement starts at, e.g. the running config's known
    capacity; the rest start at its answer, then at their side's last)."""
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
    renew: Callable[[int, list[str]], None] | None = None,
    say: Callable[[str], None] = lambda message: None,
) -> list[Comparison]:
    """Several comparisons against one running config in shared rounds, one `Comparison` per arm. A round on a
    seed nests every side's two measurements inside the others': A X1 X2 X2 X1 A for arms X1 and X2 (A B B A for
    one), so each side's two sit symmetrically about the round's middle and a drift linear over the round cancels
    in each arm's ratio; the running config is measured twice per round instead of twice per arm (the A/A check's
    arm, a second server of the running config, costs 2 measurements a round, not 4). Round `i` turns the order
    by `i` (`rotation`: X1 X2 A A X2 X1 next), so each side takes every depth in turn (module docstring); a pair
    records its round's order. An arm whose comparison has said (at least `min_pairs` pairs) leaves the later
    rounds; `min_pairs` a multiple of the number of sides keeps the turns whole until then. Arms
    need labels of their own (each side's warm start is kept by label). `renew(i, labels)`, when given, puts fresh
    servers under the sides round `i` measures (by label, in its order) before it (every side paused; paused again
    after): each pair on instances of its own (module docstring)."""
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

    priors: dict[int, dict[str, float]] = {}  # per seed: each side's last answer (A1's at first)
    for side in (running, *arms):
        side.pause()
    try:
        for i in range(max_pairs):
            live = [k for k in range(len(arms)) if not done[k]]
            if not live:
                break
            seed = seeds[i % len(seeds)]
            first = seed not in priors
            prior = priors.setdefault(seed, {side.label: start for side in (running, *arms)})
            # every side's two measurements symmetric about the round's middle, the sides rotated by round
            turn = rotation([running, *(arms[k] for k in live)], i)
            try:
                if renew is not None:
                    renew(i, [side.label for side in turn])
                    for side in (running, *arms):
                        side.pause()
                got: dict[str, list[Capacity]] = {}
                for n, side in enumerate([*turn, *reversed(turn)]):
                    cap = _measure(side, seed, prior, f"p{i}-{n}")
                    got.setdefault(side.label, []).append(cap)
                    if first and n == 0 and cap.multiplier > 0:  # the seed's first answer: where the rest start
                        for other in turn[1:]:
                            prior[other.label] = cap.multiplier
                a1, a2 = got[running.label]
            except NotMeasuredError as exc:  # the sender's limit, not a config's: the round is void, and so is the rest
                for k in live:
                    outs[k].not_measured = f"pair {i + 1}, seed {seed}: {exc.reason}"
                    outs[k].verdict = INCONCLUSIVE
                    say(f"{who(k)}pair {i + 1} (seed {seed}): {outs[k].sentence()}")
                break
            order = [side.label for side in turn]
            for k in live:
                b1, b2 = got[arms[k].label]
                done[k] = _add_pair(outs[k], seed, (a1, b1, b2, a2), floor_rps=floor_rps, min_pairs=min_pairs)
                outs[k].pairs[-1]["order"] = [*order, *reversed(order)]
                rps = ", ".join(f"{c.estimate_rps:.2f}" for c in (a1, b1, b2, a2))
                say(f"{who(k)}pair {i + 1} (seed {seed}): capacities {rps} req/s; {outs[k].sentence()}")
    finally:
        for side in (running, *arms):
            side.resume()
    for k, out in enumerate(outs):
        out.budget_ended = not done[k] and len(out.pairs) >= max_pairs and out.verdict == INCONCLUSIVE
    return outs


def rotation(sides: Sequence[T], i: int) -> list[T]:
    """Round `i`'s order of the sides' first measurements (their second ones follow in reverse): the list turned
    by `i`, so over as many rounds as sides each side is measured at every depth of the nesting once."""
    k = i % len(sides)
    return [*sides[k:], *sides[:k]]


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


def _measure(side: Side, seed: int, prior: dict[str, float], tag: str) -> Capacity:
    """One capacity of `side` with the other paused: resumed for it, paused after, warm-started at its last (a
    short search that goes on as a scout when it does not bracket: `tuner.capacity.near`)."""
    side.resume()
    try:
        cap = side.capacity(seed=seed, start=prior[side.label], tag=tag)
    finally:
        side.pause()
    if cap.multiplier > 0:
        prior[side.label] = cap.multiplier
    return cap


@dataclass
class ReplayerSide:
    """A `Side` on any `tuner.capacity.Replayer`: the held-out seed's requests from `requests(seed)`, each
    measurement `tuner.capacity.near` from the prior (a short search of `max_replays`; a scout of `scout_replays`
    from past it when that did not bracket), pausing through the given callables."""

    label: str
    backend: Replayer
    config: Any
    requests: Callable[[int], tuple[list[W.WorkloadRequest], list[list[int]]]]
    slo: SLO
    name: str
    max_replays: int = 4  # a short search's bound: it stops earlier, at its first bracket
    scout_replays: int = 6
    on_pause: Callable[[], None] = lambda: None
    on_resume: Callable[[], None] = lambda: None
    measured: list[Capacity] = field(default_factory=list)

    def capacity(self, *, seed: int, start: float, tag: str) -> Capacity:
        reqs, prompts = self.requests(seed)
        cap = replay_capacity_near(
            self.backend,
            self.config,
            reqs,
            prompts,
            slo=self.slo,
            run_id=f"{self.name}-{self.label}-s{seed}-{tag}",
            start=start,
            max_replays=self.max_replays,
            wide_replays=self.scout_replays,
        )
        self.measured.append(cap)
        return cap

    def pause(self) -> None:
        self.on_pause()

    def resume(self) -> None:
        self.on_resume()
