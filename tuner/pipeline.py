"""One tuning pipeline for every engine: baseline -> screen -> confirm -> held-out -> proposal.

`run` drives a `Target` through the phases in order: kvpilot's engine through any of its backends (the
simulator, the in-process torch engine, a live engine: `tuner.nightly.KvpilotTarget`, what `kvpilot tune nightly`
and the demo run) or a vLLM it restarts per trial (`tuner.vllm.tune.VllmTuning`, what `kvpilot tune vllm study`,
`tune vllm nightly` and `kvpilot bench tune-vllm` run). What each phase does is the target's:
1. `baseline`: the running config's SLO capacity on the first tuning seed (`tuner.capacity`), on its own server;
2. `screen`: the search (an Optuna study on the backend; for a vLLM a study in the calibrated simulator whose
   best few are measured live);
3. `confirm`: the candidate, its changes pruned to those that measurably matter, or why there is none;
4. `held_out`: the running config against the candidate on new workload seeds (`tuner.compare`: capacity in ABBA
   pairs until the 90% interval of the ratio says);
5. `finish`: the report, and a proposal in the engine's own config form only when the decision says so.

What must be the same for every engine is here, once:
- the gain rule: a candidate that differs from the running config is always compared live, and a proposal is
  written only when the comparison's verdict is `proposal` (the whole interval above 1 and above the margin);
- the decision's words: "propose: serves +X% traffic at the same SLOs (90% interval a..b, n ABBA pairs)", or
  "no proposal: " and why (the comparison's sentence, or what the search found);
- headroom: when the traffic is under the running config's capacity, by how much, and which config measured
  more (an operator whose traffic fits has no reason to restart, and should still know where the margin is);
- each phase's wall time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from tuner.capacity import Capacity
from tuner.compare import PROPOSAL, Comparison

log = logging.getLogger("kvpilot.tuner.pipeline")

PHASES = ("baseline", "screen", "confirm", "held_out", "finish")
R = TypeVar("R", covariant=True)


@dataclass(frozen=True)
class Choice:
    """What `confirm` chose: a candidate config that differs from the running one, or none and why (said after
    "no proposal: "). `rivals`: other measured configs and their capacity on the first tuning seed (req/s),
    for the headroom line."""

    candidate: Any | None
    why_not: str = ""
    rivals: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.candidate is None and not self.why_not:
            raise ValueError("why_not: a choice without a candidate says why")


@dataclass
class Verdict:
    """The pipeline's answer, handed to `Target.finish`: the decision, whether to write a proposal, and what it
    rests on."""

    decision: str
    propose: bool
    running: Capacity
    candidate: Any | None
    comparison: Comparison | None
    notes: list[str] = field(default_factory=list)  # the headroom line and the target's own (extra memory)
    phases_s: dict[str, float] = field(default_factory=dict)


class Target(Protocol, Generic[R]):
    """One engine's way through the phases (module docstring); `finish` returns the target's outcome."""

    def baseline(self) -> Capacity: ...

    def screen(self) -> None: ...

    def confirm(self) -> Choice: ...

    def held_out(self, candidate: Any) -> Comparison: ...

    def finish(self, verdict: Verdict) -> R: ...


def decide(choice: Choice, comparison: Comparison | None) -> tuple[str, bool]:
    """The decision's words and whether a proposal is written: the one gain rule (module docstring)."""
    if choice.candidate is None or comparison is None:
        return f"no proposal: {choice.why_not or 'no candidate was compared'}", False
    if comparison.verdict == PROPOSAL:
        return f"propose: {comparison.sentence()}", True
    return f"no proposal: {comparison.sentence()}", False


def headroom(running: Capacity, rivals: tuple[tuple[str, float], ...] = ()) -> str | None:
    """When the traffic is under the running config's capacity: how much, and the rival that measured the most
    capacity above it; None when the traffic is at or past capacity."""
    if running.multiplier <= 1.0:
        return None
    line = (
        f"the traffic ({running.rate_rps:.2f} req/s) is {1 / running.multiplier:.0%} of the running config's "
        f"capacity ({running.capacity_rps:.2f} req/s): {running.multiplier - 1:.0%} headroom"
    )
    more = [r for r in rivals if r[1] > running.estimate_rps]
    if more:
        label, rps = max(more, key=lambda r: r[1])
        line += f"; {label} would have {rps:.2f} req/s"
    return line


def run(target: Target[R], *, notes: list[str] | None = None) -> R:
    """The phases in order (module docstring); the target's outcome. `notes`: lines of the caller's that join
    the verdict's (the target adds its own in `finish`)."""
    phases: dict[str, float] = {}

    def timed(name: str, since: float) -> None:
        phases[f"{name}_s"] = round(time.time() - since, 1)

    t = time.time()
    running = target.baseline()
    timed("baseline", t)
    t = time.time()
    target.screen()
    timed("screen", t)
    t = time.time()
    choice = target.confirm()
    timed("confirm", t)
    comparison = None
    if choice.candidate is not None:
        t = time.time()
        comparison = target.held_out(choice.candidate)
        timed("held_out", t)
    decision, propose = decide(choice, comparison)
    log.info("tuning: %s", decision)
    lines = [line for line in (headroom(running, choice.rivals),) if line] + list(notes or [])
    verdict = Verdict(decision, propose, running, choice.candidate, comparison, lines, phases)
    t = time.time()
    outcome = target.finish(verdict)
    timed("finish", t)
    return outcome
