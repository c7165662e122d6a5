"""Calibration: the fit recovers a known cost model; the recorder measures real engine steps."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.config import EngineConfig
from engine.executor import TorchExecutor
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from tuner.calibrate import SWAP_RUN, GridRunner, RecordingExecutor, Sample, _batch, fit, jitter_quantiles
from tuner.profile import StepShape
from tuner.replay import SkipClock, TrialSink

from .conftest import TINY_MODEL, tiny_profile


def _shape(rng: random.Random) -> StepShape:
    if rng.random() < 0.3:
        n = rng.randint(16, 1024)
        return StepShape(prefill_tokens=n, prefill_seqs=1, attn_pairs=n * (n + 1) // 2, prefill_ctx_tokens=n)
    b = rng.randint(1, 64)
    ctx = b * rng.randint(16, 2048)
    return StepShape(
        decode_seqs=b,
        decode_ctx_tokens=ctx,
        decode_attn_tokens=ctx + rng.randint(0, 8 * b),
        decode_groups=rng.randint(1, 4),
        decode_blocks=ctx // rng.choice((16, 32, 64)),
    )


def test_fit_recovers_known_coefficients_despite_noise_and_stragglers() -> None:
    rng = random.Random(0)
    truth = {"c0": 0.002, "prefill_tokens": 6e-5, "decode_seqs": 3e-4, "decode_attn_tokens": 5e-7}

    def cost(s: StepShape) -> float:
        return (
            truth["c0"]
            + truth["prefill_tokens"] * s.prefill_tokens
            + truth["decode_seqs"] * s.decode_seqs
            + truth["decode_attn_tokens"] * s.decode_attn_tokens
        )

    samples = []
    for i in range(600):
        s = _shape(rng)
        t = cost(s) * (1 + rng.gauss(0, 0.03))
        if i % 25 == 0:
            t *= 8  # a step that waited for a noisy neighbour
        samples.append(Sample(s, t))
    coef, stats = fit(samples)
    # a synthetic prefill reads exactly its own tokens: prefill and prefill-context tokens are one feature
    assert coef.prefill_tokens + coef.prefill_ctx_tokens == pytest.approx(truth["prefill_tokens"], rel=0.05)
    # context and padded-attention tokens are nearly collinear here: only their sum is identified
    assert coef.decode_ctx_tokens + coef.decode_attn_tokens == pytest.approx(truth["decode_attn_tokens"], rel=0.1)
    assert coef.c0_s == pytest.approx(truth["c0"], rel=0.25)
    profile = tiny_profile(
        **{k: 0.0 for k in ("prefill_tokens", "prefill_seqs", "decode_seqs", "decode_attn_tokens", "swap_tokens")}
    )
    profile = profile.model_copy(update={"linear": coef})
    held_out = [_shape(rng) for _ in range(300)]
    errors = sorted(abs(profile.predict(s) - cost(s)) / cost(s) for s in held_out)
    assert errors[len(errors) // 2] < 0.03 and errors[int(0.9 * len(errors))] < 0.08
    assert stats["dropped"] >= 20 and stats["samples"] == 600
    with pytest.raises(ValueError, match="need at least"):
        fit(samples[:3])


def test_fit_predicts_the_mean_step_cost_under_skewed_noise() -> None:
    """A shared CPU makes some steps slower, never faster: the simulator needs the mean cost of a shape.
    Weighting errors by the measured time (instead of the prediction) leans towards the fast steps and
    under-predicts the total."""
    rng = random.Random(1)
    truth = {"c0": 0.002, "prefill_tokens": 6e-5, "decode_seqs": 3e-4, "decode_attn_tokens": 5e-7}

    def cost(s: StepShape) -> float:
        return (
            truth["c0"]
            + truth["prefill_tokens"] * s.prefill_tokens
            + truth["decode_seqs"] * s.decode_seqs
            + truth["decode_attn_tokens"] * s.decode_attn_tokens
        )

    slow, share = 1.6, 0.25  # a quarter of the steps run 1.6x slower: the mean step costs 1.15x
    samples = []
    for _ in range(2000):
        s = _shape(rng)
        samples.append(Sample(s, cost(s) * (slow if rng.random() < share else 1.0) * (1 + rng.gauss(0, 0.02))))
    coef, stats = fit(samples)
    assert stats["total_ratio"] == pytest.approx(1.0, abs=0.02) and stats["dropped"] == 0
    profile = tiny_profile().model_copy(update={"linear": coef})
    mean = 1 + share * (slow - 1)
    ratios = sorted(profile.predict(s) / cost(s) for s in (_shape(rng) for _ in range(300)))
    assert ratios[len(ratios) // 2] == pytest.approx(mean, rel=0.03)
    # The spread around that mean, for the simulator to draw from: three steps in four at 1/1.15 of the
    # mean, one in four at 1.6/1.15; the quantiles average 1.
    q = jitter_quantiles(samples, coef, n=21)
    assert len(q) == 21 and sum((a + b) / 2 for a, b in itertools.pairwise(q)) / 20 == pytest.approx(1.0, abs=1e-3)
    assert q[10] == pytest.approx(1 / mean, rel=0.04) and q[18] == pytest.approx(slow / mean, rel=0.04)
    with pytest.raises(ValueError, match="at least 21 steps"):
        jitter_quantiles(samples[:10], coef, n=21)


def test_recording_executor_measures_back_to_back_cycles() -> None:
    cfg = EngineConfig.from_dict({"device": "cpu", "model": dict(TINY_MODEL), "warmup": {"requests": 0}})
    rec = RecordingExecutor(TorchExecutor(cfg))
    engine = LLMEngine(cfg, executor=rec, clock=SkipClock(), sink=TrialSink())
    rec.recording = True
    for i in range(4):
        engine.add_request([256] + [i] * 40, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.run_until_done()
    samples = rec.samples()
    assert len(samples) == 5  # one prefill step, four decode steps
    assert samples[0].shape.prefill_seqs == 4 and samples[1].shape.decode_seqs == 4
    assert all(s.seconds > 0 for s in samples)
    # a cycle covers the whole step (scheduling and bookkeeping too), so it is at least the forward time
    assert all(c.seconds >= raw[3] for c, raw in zip(samples[1:], rec.raw[1:], strict=True))


def test_grid_runner_records_only_the_runs_it_measures() -> None:
    cfg = EngineConfig.from_dict({"device": "cpu", "model": dict(TINY_MODEL), "warmup": {"requests": 0}})
    runner = GridRunner(cfg, quick=True)
    assert runner.names[-1] == SWAP_RUN and any(n.startswith("mixed rate") for n in runner.names)
    runner.runs = {  # the same plumbing on runs small enough for a test
        "a": lambda e, s: _batch(e, 2, 40, 3, s),
        "b": lambda e, s: _batch(e, 1, 20, 4, s),
        SWAP_RUN: lambda e, s: _batch(e, 1, 30, 2, s),
    }
    runner.warm_up()
    assert runner.samples() == []
    runner.measure(["a"])
    assert [s.shape.prefill_seqs for s in runner.samples()] == [2, 0, 0]  # one prefill step, two decode steps
    runner.measure(["b", SWAP_RUN], seed=5)
    assert len(runner.samples()) == 3 + 4 + 2 and len(runner.swap_rec.raw) == 2
    assert not runner.rec.recording  # nothing outside measure() is recorded
    runner.clear()
    assert runner.samples() == []
