"""The one tuning pipeline: the phases' order, the gain rule, the decision's words and the headroom line, on a
target that records what it was asked."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tuner import pipeline
from tuner.capacity import Capacity
from tuner.compare import INCONCLUSIVE, NO_GAIN, PROPOSAL, Comparison, Interval
from tuner.pipeline import Choice, Verdict


def _capacity(multiplier: float, rate: float = 10.0) -> Capacity:
    return Capacity(rate_rps=rate, multiplier=multiplier, upper=multiplier * 1.15)


def _comparison(verdict: str, ratio: float = 1.2, low: float = 1.1, high: float = 1.3) -> Comparison:
    c = Comparison("running", "candidate", 0.03, [1000, 1001])
    c.interval = Interval(ratio, low, high, 2)
    c.verdict = verdict
    c.pairs = [{"running": [10.0, 10.0], "candidate": [12.0, 12.0]}] * 2
    return c


class _Target:
    def __init__(self, choice: Choice, comparison: Comparison | None = None, running: float = 2.0) -> None:
        self.choice, self.comparison, self.running = choice, comparison, running
        self.calls: list[str] = []
        self.compared: Any = None

    def baseline(self) -> Capacity:
        self.calls.append("baseline")
        return _capacity(self.running)

    def screen(self) -> None:
        self.calls.append("screen")

    def confirm(self) -> Choice:
        self.calls.append("confirm")
        return self.choice

    def held_out(self, candidate: Any) -> Comparison:
        self.calls.append("held_out")
        self.compared = candidate
        assert self.comparison is not None
        return self.comparison

    def finish(self, verdict: Verdict) -> Verdict:
        self.calls.append("finish")
        return verdict


def test_a_candidate_is_always_compared_and_proposed_only_on_the_verdict_proposal() -> None:
    target = _Target(Choice({"block_size": 32}), _comparison(PROPOSAL))
    verdict = pipeline.run(target)
    assert target.calls == ["baseline", "screen", "confirm", "held_out", "finish"]
    assert target.compared == {"block_size": 32} and verdict.candidate == {"block_size": 32}
    assert verdict.propose and verdict.decision == f"propose: {target.comparison.sentence()}"
    assert verdict.decision.startswith("propose: serves +20.0% traffic at the same SLOs (90% interval +10.0%..+30.0%")
    assert set(verdict.phases_s) == {"baseline_s", "screen_s", "confirm_s", "held_out_s", "finish_s"}
    for other in (NO_GAIN, INCONCLUSIVE):  # anything but `proposal` writes none, and says the comparison's words
        comparison = _comparison(other, 1.01, 0.99, 1.02)
        verdict = pipeline.run(_Target(Choice({"block_size": 32}), comparison))
        assert not verdict.propose and verdict.decision == f"no proposal: {comparison.sentence()}"


def test_without_a_candidate_nothing_is_compared_and_the_decision_says_why() -> None:
    target = _Target(Choice(None, "the current config is already the best found"))
    verdict = pipeline.run(target)
    assert target.calls == ["baseline", "screen", "confirm", "finish"]
    assert not verdict.propose and verdict.comparison is None and "held_out_s" not in verdict.phases_s
    assert verdict.decision == "no proposal: the current config is already the best found"
    with pytest.raises(ValueError, match="why_not"):
        Choice(None)


def test_headroom_says_how_much_and_which_rival_measured_more() -> None:
    rivals = (("block_size=32", 35.0), ("max_num_seqs=64", 41.0), ("max_num_seqs=8", 12.0))
    line = pipeline.headroom(_capacity(3.0), rivals)
    assert line == (
        "the traffic (10.00 req/s) is 33% of the running config's capacity (30.00 req/s): 200% headroom; "
        "max_num_seqs=64 would have 41.00 req/s"
    )
    assert pipeline.headroom(_capacity(3.0), (("block_size=32", 29.0),)).endswith("200% headroom")
    assert pipeline.headroom(_capacity(1.0)) is None and pipeline.headroom(_capacity(0.5)) is None
    # the verdict carries it, then the caller's notes
    verdict = pipeline.run(_Target(Choice(None, "nothing better", rivals), running=3.0), notes=["a note"])
    assert verdict.notes[0].startswith("the traffic (10.00 req/s)") and verdict.notes[1:] == ["a note"]
    assert pipeline.run(_Target(Choice(None, "nothing better"), running=0.8)).notes == []


def test_decide_reads_only_the_verdict() -> None:
    assert pipeline.decide(Choice("c"), _comparison(PROPOSAL))[1]
    # an interval above 1 whose verdict is not `proposal` (e.g. a capacity not found) proposes nothing
    assert not pipeline.decide(Choice("c"), _comparison(INCONCLUSIVE))[1]
    assert pipeline.decide(Choice(None, "why"), None) == ("no proposal: why", False)
    assert math.isclose(_comparison(PROPOSAL).gain, 0.2)
