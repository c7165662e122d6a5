"""SLO capacity (`tuner.capacity`) on the simulator in vLLM's mode (a fitted cost model of the engine, no vLLM),
and the ABBA comparison's statistics (`tuner.compare`) on synthetic paired samples of known distributions."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import pytest

from collector.db import make_engine
from collector.queries import stored_steps
from integrations.vllm.config import VllmConfig
from tests.tuner.test_vllm_sim import CKPT_MODEL, _synthetic_steps
from tuner import capacity
from tuner import workloads as WL
from tuner.capacity import (
    MIN_FINISHED,
    arrival_rate,
    at_rate,
    at_rate_requests,
    breaches,
    replay_capacity,
    requests_at,
)
from tuner.compare import INCONCLUSIVE, NO_GAIN, PROPOSAL, interval, pair_log_ratio, verdict
from tuner.metrics import SLO, TrialMetrics, store_events
from tuner.replay import prepare_prompts
from tuner.vllm.calibrate import fit_profile
from tuner.vllm.sim import VllmSimBackend
from tuner.vllm.space import at_fixed_memory, load_vllm_space, memory_changes

SLO_CAP = SLO(ttft_s=0.5, tpot_s=0.05, p99_ttft_s=0.5)


@pytest.fixture
def sim(sqlite_url: str):
    db = make_engine(sqlite_url)
    store_events(db, _synthetic_steps(300), key_prefix="cal")
    profile = fit_profile(stored_steps(db, start=0, end=2e9), model=CKPT_MODEL, block_size=128)
    opts = WL.WorkloadOptions(requests=64, scale=4.0, output_range=(32, 96), max_total_tokens=512)
    reqs = WL.scenario("mixed", 6.0, opts, seed=3)
    yield VllmSimBackend(profile, lambda seed: reqs, db, SLO_CAP), reqs, prepare_prompts(reqs, 3)
    db.dispose()


def test_at_rate_multiplies_the_rate_over_the_recordings_own_span_with_bursts_kept() -> None:
    opts = WL.WorkloadOptions(requests=40, scale=8.0, output_range=(16, 64))
    reqs = WL.scenario("burst", 10.0, opts, seed=0)
    prompts = prepare_prompts(reqs, 0)
    rate, span = arrival_rate(reqs), reqs[-1].arrival_s - reqs[0].arrival_s
    for m in (2.0, 4.0, 2.5, 7.3):
        fast, fast_prompts = at_rate(reqs, prompts, m)
        assert len(fast) == len(fast_prompts) == requests_at(reqs, m)
        # m times as many requests (a fraction of a repeat: the recording's first part, its burst or not) ...
        assert len(fast) == m * len(reqs) if m.is_integer() else m - 1 < len(fast) / len(reqs) < m + 1
        assert arrival_rate(fast) == pytest.approx(m * rate, rel=0.15)  # ... at m times the rate ...
        assert fast[-1].arrival_s - fast[0].arrival_s == pytest.approx(span, rel=0.1)  # ... over the same span
    fast, fast_prompts = at_rate(reqs, prompts, 4.0)
    # the first repeat is the recording compressed: its gaps divided by 4, its lengths and prompts kept
    first = fast[: len(reqs)]
    t0 = reqs[0].arrival_s
    assert [(r.arrival_s - t0) * 4 for r in first] == pytest.approx([r.arrival_s - t0 for r in reqs])
    assert [(r.prompt_tokens, r.output_tokens) for r in first] == [(r.prompt_tokens, r.output_tokens) for r in reqs]
    assert fast_prompts[: len(reqs)] == prompts
    # repeats: the same lengths, prompts of the same length and BOS, none equal to another repeat's
    assert len({tuple(p) for p in fast_prompts}) == len(fast_prompts)
    assert all(len(p) == len(prompts[i % len(reqs)]) and p[0] == prompts[0][0] for i, p in enumerate(fast_prompts))
    # under x1: thinned evenly, arrivals kept, never empty
    slow, _ = at_rate(reqs, prompts, 0.5)
    assert len(slow) == len(reqs) // 2 and {r.arrival_s for r in slow} <= {r.arrival_s for r in reqs}
    assert len(at_rate(reqs, prompts, 1 / 1000)[0]) == 1
    with pytest.raises(ValueError, match="multiplier"):
        at_rate(reqs, prompts, 0.0)
    with pytest.raises(ValueError, match="prompts"):
        at_rate(reqs, prompts[:-1], 2.0)
    with pytest.raises(ValueError, match="at once"):
        arrival_rate([r for r in reqs if r.arrival_s == reqs[0].arrival_s] * 2)


def test_repeats_share_prefixes_within_themselves_not_with_each_other() -> None:
    opts = WL.WorkloadOptions(requests=48, scale=8.0, output_range=(16, 64))
    plain = WL.scenario("mixed", 8.0, opts, seed=1)
    reqs = [dataclasses.replace(r, prefix_group=i % 3 if i % 4 else None) for i, r in enumerate(plain)]
    groups = {0, 1, 2}
    tiled = at_rate_requests(reqs, 3.0)
    by_repeat = [{r.prefix_group for r in tiled[k * len(reqs) : (k + 1) * len(reqs)]} - {None} for k in range(3)]
    assert by_repeat[0] == groups and len(by_repeat[1]) == len(groups)
    assert not by_repeat[0] & by_repeat[1] and not by_repeat[1] & by_repeat[2]
    # live prompts: one repeat's requests of a group keep one prefix, another repeat's another
    prompts = prepare_prompts(reqs, 1)
    _, tiled_prompts = at_rate(reqs, prompts, 2.0)
    a, b = [i for i, r in enumerate(reqs) if r.prefix_group == 1][:2]
    n = len(reqs)
    assert tiled_prompts[a][:8] == tiled_prompts[b][:8]
    assert tiled_prompts[n + a][:8] == tiled_prompts[n + b][:8] != tiled_prompts[a][:8]


def test_a_recording_too_short_to_load_a_server_still_finds_its_limit(sim) -> None:
    """The first version compressed the recording: at x32, 40 requests became one batch any config absorbed. At a
    multiple of the rate over the recording's own span, the queue grows past capacity and the SLOs fail."""
    backend, reqs, prompts = sim
    short = reqs[:16]
    config = VllmConfig(model="/m", kv_cache_memory_bytes=16 * 2**20)
    cap = replay_capacity(backend, config, short, prompts[:16], slo=SLO_CAP, run_id="short", max_replays=12)
    assert cap.bracketed and cap.found and cap.multiplier < 256
    assert requests_at(short, cap.upper) > len(short)


def test_the_search_stops_growing_at_the_replay_size_bound(sim, monkeypatch) -> None:
    backend, reqs, prompts = sim
    config = VllmConfig(model="/m", kv_cache_memory_bytes=16 * 2**20)
    monkeypatch.setattr(capacity, "MAX_REPLAY_REQUESTS", 600)
    lax = SLO(ttft_s=1e6, tpot_s=1e6, p99_ttft_s=1e6)  # every rate holds: only the size bound stops the search
    cap = replay_capacity(backend, config, reqs[:8], prompts[:8], slo=lax, run_id="bound", max_replays=12)
    assert not cap.found and cap.upper is None and cap.multiplier < capacity.MAX_MULTIPLIER
    assert requests_at(reqs[:8], cap.multiplier) <= 600 < requests_at(reqs[:8], 2 * cap.multiplier)
    assert max(p.metrics.requests for p in cap.probes) <= 600


def test_capacity_search_brackets_the_largest_rate_that_meets_the_slos(sim) -> None:
    backend, reqs, prompts = sim
    config = VllmConfig(model="/m", kv_cache_memory_bytes=16 * 2**20)
    cap = replay_capacity(backend, config, reqs, prompts, slo=SLO_CAP, run_id="cap", rel_tol=0.05, max_replays=12)
    assert cap.bracketed and cap.upper / cap.multiplier <= 1.05 and len(cap.probes) <= 12
    assert cap.capacity_rps == pytest.approx(cap.multiplier * arrival_rate(reqs))
    held = [p.multiplier for p in cap.probes if p.holds]
    failed = [p.multiplier for p in cap.probes if not p.holds]
    assert max(held) == cap.multiplier and min(failed) == cap.upper and cap.multiplier < cap.upper
    assert all(not p.breaches for p in cap.probes if p.holds) and all(p.breaches for p in cap.probes if not p.holds)
    # the answer is what a replay at it says: deterministic, so the same replays hold and fail again
    again = backend.measure_requests(config, *at_rate(reqs, prompts, cap.multiplier), run_id="again")
    past = backend.measure_requests(config, *at_rate(reqs, prompts, cap.upper), run_id="past")
    assert breaches(again, SLO_CAP) == () and breaches(past, SLO_CAP) != ()
    assert again.finished >= MIN_FINISHED * again.requests
    assert cap.goodput_at_rate_tps is not None and cap.goodput_at_rate_tps > 0  # the search started at x1


def test_a_config_that_serves_less_has_less_capacity_and_the_budget_bounds_the_search(sim) -> None:
    backend, reqs, prompts = sim
    roomy = VllmConfig(model="/m", kv_cache_memory_bytes=16 * 2**20)
    starved = roomy.replace(max_num_seqs=2)
    wide = replay_capacity(backend, roomy, reqs, prompts, slo=SLO_CAP, run_id="roomy", max_replays=10)
    narrow = replay_capacity(backend, starved, reqs, prompts, slo=SLO_CAP, run_id="starved", max_replays=10)
    assert 0 < narrow.capacity_rps < wide.capacity_rps
    short = replay_capacity(backend, roomy, reqs, prompts, slo=SLO_CAP, run_id="short", max_replays=2)
    assert len(short.probes) == 2 and short.multiplier <= wide.upper
    with pytest.raises(ValueError, match="max_replays"):
        replay_capacity(backend, roomy, reqs, prompts, slo=SLO_CAP, run_id="none", max_replays=0)
    impossible = SLO(ttft_s=1e-6, tpot_s=0.1, p99_ttft_s=1e-6)  # no rate meets it: the search gives up at the floor
    zero = replay_capacity(backend, roomy, reqs, prompts, slo=impossible, run_id="zero", max_replays=12)
    assert zero.multiplier == 0.0 and zero.capacity_rps == 0.0 and not zero.bracketed


def test_memory_is_held_at_the_running_configs_unless_allowed() -> None:
    base = VllmConfig(model="/m", kv_cache_memory_bytes=16 * 2**20)
    space = load_vllm_space(base=base)
    assert "kv_cache_memory_bytes" in space.names
    fixed = at_fixed_memory(space, base)
    assert "kv_cache_memory_bytes" not in fixed.names and fixed.fixed["kv_cache_memory_bytes"] == 16 * 2**20
    trial = fixed.apply(base, {"max_num_seqs": 32})
    assert trial.kv_cache_memory_bytes == 16 * 2**20 and memory_changes(base, trial) == {}
    more = space.apply(base, {"kv_cache_memory_bytes": 64 * 2**20})
    assert memory_changes(base, more) == {"kv_cache_memory_bytes": (16 * 2**20, 64 * 2**20)}


def _pairs(rng: random.Random, n: int, *, gain: float, noise: float) -> list[float]:
    """Paired log ratios of ABBA pairs: each capacity drawn around its true value with `noise` (relative sd), the
    machine's speed drifting over the pair (which the AB/BA halves cancel)."""
    out = []
    for _ in range(n):
        drift = [1.0 + 0.05 * k for k in range(4)]
        a1, b1, b2, a2 = (
            10.0 * d * (1 + gain * (k in (1, 2))) * math.exp(rng.gauss(0, noise)) for k, d in enumerate(drift)
        )
        out.append(pair_log_ratio(a1, b1, b2, a2, floor=0.01))
    return out


def test_equal_configs_are_never_a_proposal_and_a_clear_gain_is() -> None:
    rng = random.Random(7)
    equal = [verdict(interval(_pairs(rng, 4, gain=0.0, noise=0.08)), margin=0.03) for _ in range(200)]
    assert equal.count(PROPOSAL) <= 10  # a 90% interval is above 1 by chance 5% of the time: 10 of 200
    quiet = [verdict(interval(_pairs(rng, 6, gain=0.0, noise=0.01)), margin=0.03) for _ in range(50)]
    assert set(quiet) == {NO_GAIN}  # equivalent within the margin
    better = [verdict(interval(_pairs(rng, 4, gain=0.3, noise=0.05)), margin=0.03) for _ in range(50)]
    assert set(better) == {PROPOSAL}
    worse = [verdict(interval(_pairs(rng, 4, gain=-0.3, noise=0.05)), margin=0.03) for _ in range(50)]
    assert set(worse) == {NO_GAIN}


def test_the_interval_is_the_t_interval_of_the_log_ratios() -> None:
    iv = interval([math.log(1.1), math.log(1.3)])
    mean, sd = math.log(math.sqrt(1.1 * 1.3)), (math.log(1.3) - math.log(1.1)) / math.sqrt(2)
    assert iv.ratio == pytest.approx(math.exp(mean))
    assert iv.low == pytest.approx(math.exp(mean - 6.314 * sd / math.sqrt(2)))
    assert iv.high == pytest.approx(math.exp(mean + 6.314 * sd / math.sqrt(2)))
    assert verdict(iv, margin=0.03) == INCONCLUSIVE  # two pairs this far apart bound nothing
    one = interval([0.2])
    assert one.low == 0.0 and math.isinf(one.high) and verdict(one, margin=0.03) == INCONCLUSIVE
    drift_only = pair_log_ratio(10.0, 11.0, 12.0, 13.0, floor=0.01)  # equal configs, speed rising linearly
    assert drift_only == pytest.approx((math.log(1.1) + math.log(12 / 13)) / 2) and abs(drift_only) < 0.01


def test_the_budget_refuses_a_comparison_that_can_only_be_inconclusive_and_ranks_are_scored() -> None:
    from tuner.vllm.tune import Budget, spearman

    with pytest.raises(ValueError, match="at least 2 ABBA pairs"):
        Budget(heldout_seeds=(1000,)).validate()
    assert Budget(heldout_seeds=(1000,), repeats=2).validate().max_pairs == 2
    with pytest.raises(ValueError, match="pair_replays"):
        Budget(pair_replays=1).validate()
    assert spearman([1.0, 2.0, 3.0], [10.0, 30.0, 20.0]) == pytest.approx(0.5)
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert spearman([1.0, 1.0, 2.0], [5.0, 6.0, 7.0]) == pytest.approx(math.sqrt(3) / 2)  # ties: mean ranks
    assert spearman([1.0], [2.0]) is None and spearman([1.0, 1.0], [2.0, 3.0]) is None


class _FixedSide:
    """A compare() side whose every search answers the same capacity (rate 1 req/s), open-ended or bracketed."""

    def __init__(self, label: str, multiplier: float, *, bracketed: bool, wobble: float = 0.0) -> None:
        self.label, self.multiplier, self.bracketed, self.wobble = label, multiplier, bracketed, wobble
        self.calls = 0

    def capacity(self, *, seed: int, start: float, tag: str):
        from tuner.capacity import Capacity

        self.calls += 1
        m = self.multiplier * (1 + self.wobble * (-1) ** self.calls)
        return Capacity(rate_rps=1.0, multiplier=m, upper=m * 1.25 if self.bracketed else None)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


def test_a_ratio_of_lower_bounds_is_never_a_proposal() -> None:
    """The first bench run's held-out phase: the running config's search stopped at x32 within its budget and the
    candidate's at x256, both still meeting the SLOs: +700% of nothing. Bracketed, the same ratio proposes."""
    from tuner.compare import compare

    run = dict(seeds=[1000, 1001, 1002], start=1.0, floor_rps=0.01, min_pairs=2, max_pairs=3)
    bracketed = compare(
        _FixedSide("running", 32.0, bracketed=True, wobble=0.01),
        _FixedSide("candidate", 64.0, bracketed=True, wobble=0.01),
        **run,
    )
    assert bracketed.verdict == PROPOSAL and bracketed.lower_bounds == [], bracketed.as_dict()
    candidate = _FixedSide("candidate", 256.0, bracketed=False)
    open_ended = compare(_FixedSide("running", 32.0, bracketed=True), candidate, **run)
    assert open_ended.verdict == INCONCLUSIVE and open_ended.lower_bounds == [256.0] * 4
    assert len(open_ended.pairs) == 2 and candidate.calls == 4  # more pairs cannot bracket it: stopped at min_pairs
    assert "capacity not found" in open_ended.sentence() and open_ended.pairs[0]["bracketed"] is False
    assert open_ended.as_dict()["capacity_not_found_rps"] == [256.0] * 4


def test_a_search_that_never_held_above_the_floor_found_no_capacity() -> None:
    """Held-out pairs of the same bench run measured 0, 0, 0, 0: each short search failed from x32 down to x13 and
    its budget ended. That is no capacity; a 0 is one only when the smallest multiplier failed too."""
    from tuner.capacity import MIN_MULTIPLIER, Capacity, Probe

    def probes(*ms: float) -> list[Probe]:
        return [Probe(multiplier=m, holds=False, breaches=("p99 TTFT",), metrics=None) for m in ms]

    assert not Capacity(rate_rps=3.6, probes=probes(32.0, 25.6, 20.5, 16.4)).found
    assert Capacity(rate_rps=3.6, probes=probes(1.0, 0.1, MIN_MULTIPLIER)).found
    assert Capacity(rate_rps=3.6, multiplier=2.0, upper=2.5).found
    assert not Capacity(rate_rps=3.6, multiplier=256.0).found


class _Threshold:
    """A `Replayer` that meets the SLOs exactly when the replay's rate is at most its seed's true capacity (a
    multiple of that seed's own rate), and counts its replays."""

    def __init__(self, workloads: dict[int, list], true_multiplier: dict[int, float]) -> None:
        self.workloads, self.true_multiplier, self.replays = workloads, true_multiplier, 0

    def measure_requests(self, config, reqs, prompts, *, run_id: str) -> TrialMetrics:
        self.replays += 1
        seed = int(run_id.split("-s")[1].split("-")[0])
        holds = requests_at(self.workloads[seed], self.true_multiplier[seed]) >= len(reqs)
        ttft = 0.1 if holds else 10.0
        return TrialMetrics(
            "r", 1.0, len(reqs), len(reqs), 0, 0, 1.0, 1.0, 1.0, 1.0, 0.0, ttft, ttft, 0.01, 0.1, 0.1, 0, 0
        )


def test_a_held_out_seed_far_from_the_known_capacity_is_still_bracketed_and_a_near_one_costs_two_replays() -> None:
    """The fourth bench run's A/A check: the tuning seed's capacity was x3.67; held-out seed 1000 took less, and
    every short search started at x3.67 failed at each rate it reached (0, 0, 0, 0: no capacity). A short search
    that ends without a bracket goes on as a scout from past its last rate, so a seed far under (or over) the
    known capacity is still measured; a seed near it costs 2 replays a measurement (bench run 21 scouted every
    seed first: 6 replays for A1 where 2 did)."""
    from tuner.compare import NO_GAIN, ReplayerSide, compare

    opts = WL.WorkloadOptions(requests=24, scale=8.0, output_range=(16, 64))
    workloads = {seed: WL.scenario("sustained", 6.0, opts, seed=seed) for seed in (1000, 1001, 1002)}
    prompts = {seed: prepare_prompts(reqs, seed) for seed, reqs in workloads.items()}
    # seed 1002 within a step of the tuning seed's x3.67, the others far under and over it
    fake = _Threshold(workloads, {1002: 3.9, 1000: 1.5, 1001: 5.0})
    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=1.0)

    def side(label: str, **kw) -> ReplayerSide:
        return ReplayerSide(label, fake, None, lambda seed: (workloads[seed], prompts[seed]), slo, "aa", **kw)

    run = dict(seeds=[1002, 1000, 1001], start=3.67, floor_rps=0.01, min_pairs=3, max_pairs=3)
    c = compare(side("running"), side("candidate"), **run)
    assert c.lower_bounds == [] and all(p["bracketed"] for p in c.pairs), c.as_dict()
    assert c.pairs[0]["replays"] == 8  # near: 2 replays for each of A1 B1 B2 A2
    assert all(p["replays"] > 8 for p in c.pairs[1:])  # far: a short search and then a scout for A1 at least
    # a step-shaped fake: each estimate is its bracket's geometric middle, and the two sides' brackets differ
    assert c.verdict == NO_GAIN and c.interval.ratio == pytest.approx(1.0, rel=0.03)
    for pair in c.pairs:
        m, rate = fake.true_multiplier[pair["seed"]], arrival_rate(workloads[pair["seed"]])
        # within a step of the truth (the fake judges by request count, which moves in whole requests)
        assert all(m / 1.2 <= x / rate <= m * 1.1 for x in pair["held"]), pair
    # with scouts too short to bracket (3 replays) a later short search goes on as a scout of its own, and finds it
    fake.replays = 0
    blind = compare(side("running", scout_replays=3), side("candidate", scout_replays=3), **run)
    assert blind.lower_bounds == [] and all(p["bracketed"] for p in blind.pairs), blind.as_dict()
    assert fake.replays == sum(p["replays"] for p in blind.pairs)  # every replay, both searches', counted


def test_a_rate_the_sender_cannot_keep_up_with_ends_the_search_with_what_it_has() -> None:
    """A tiny study on the CI's vLLM with lax SLOs grew its search to 768 requests in 1.5 s; the replay client
    sent late on every attempt and the whole study stopped ("not measured"). The search now ends there: the
    capacity is at least what held, and says why; a first replay that cannot be measured is still an error."""
    from tuner.backends import NotMeasuredError

    opts = WL.WorkloadOptions(requests=24, scale=8.0, output_range=(16, 64))
    reqs = WL.scenario("sustained", 6.0, opts, seed=1000)
    prompts = prepare_prompts(reqs, 1000)
    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=1.0)

    class LateAbove(_Threshold):
        def __init__(self, limit: int) -> None:
            super().__init__({1000: reqs}, {1000: 64.0})
            self.limit = limit

        def measure_requests(self, config, scaled, scaled_prompts, *, run_id: str) -> TrialMetrics:
            if len(scaled) > self.limit:
                raise NotMeasuredError(f"the replay client sent late in all 3 attempts ({len(scaled)} requests)")
            return super().measure_requests(config, scaled, scaled_prompts, run_id=run_id)

    cap = replay_capacity(LateAbove(5 * len(reqs)), None, reqs, prompts, slo=slo, run_id="x-s1000", max_replays=8)
    assert cap.multiplier == 4.0 and not cap.found and cap.upper is None
    assert cap.not_measured is not None and cap.not_measured.startswith("x8: the replay client sent late")
    assert cap.summary()["not_measured"] == cap.not_measured and len(cap.probes) == 3
    with pytest.raises(NotMeasuredError):
        replay_capacity(LateAbove(0), None, reqs, prompts, slo=slo, run_id="x-s1000", max_replays=8)


def test_past_capacity_only_the_tails_stop_constraining() -> None:
    """The screen and the bench's live-only search replay past the running config's capacity, where p99 TTFT
    misses its SLO by construction: judged by it, every trial was infeasible (the sixth bench run's live-only
    trials all were) and the screen confirmed nothing. Past capacity, goodput ranks them; refusals, OOM and
    unfinished work still constrain."""
    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=2.0, p99_e2e_s=5.0)
    late = TrialMetrics("r", 1.0, 10, 10, 0, 0, 1.0, 1.0, 1.0, 0.5, 0.0, 1.0, 4.0, 0.05, 1.0, 9.0, 0, 0)
    assert not late.feasible(slo) and {"p99_ttft", "p99_e2e"} <= set(late.constraints(slo))
    past = slo.past_capacity()
    assert late.feasible(past) and set(late.constraints(past)) == {"oom", "rejection"}
    refused = dataclasses.replace(late, rejection_rate=0.5)
    assert not refused.feasible(past) and past.ttft_s == slo.ttft_s and past.tails is False


class _PowerLaw:
    """A `Replayer` whose p99 TTFT grows as a power of the rate: exactly the SLO at its seed's true capacity (a
    multiple of that seed's rate), each measurement's true capacity jittered by `noise` (a lognormal sd)."""

    def __init__(
        self,
        true_multiplier: dict[int, float],
        *,
        noise: float = 0.0,
        seed: int = 0,
        late: Callable[[int, float], bool] = lambda seed, m: False,
    ) -> None:
        """`late(seed, multiplier)`: the replays whose sender lags on every attempt (not measured)."""
        self.true_multiplier, self.noise, self.rng, self.late = true_multiplier, noise, random.Random(seed), late

    def measure_requests(self, config, reqs, prompts, *, run_id: str) -> TrialMetrics:
        from tuner.backends import NotMeasuredError

        seed = int(run_id.split("-s")[1].split("-")[0])
        m = float(run_id.rsplit("-x", 1)[1])
        if self.late(seed, m):
            raise NotMeasuredError("the replay client sent late in all 5 attempts")
        true = self.true_multiplier[seed] * math.exp(self.rng.gauss(0.0, self.noise))
        ttft = 0.5 * (m / true) ** 4
        n = len(reqs)
        return TrialMetrics("r", 1.0, n, n, 0, 0, 1.0, 1.0, 1.0, 1.0, 0.0, ttft, ttft, 0.01, 0.1, 0.1, 0, 0)


def test_the_pressure_is_above_one_exactly_where_an_slo_breaks() -> None:
    from tuner.capacity import pressure

    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=0.5)

    def metrics(ttft: float | None, tpot: float | None, finished: int) -> TrialMetrics:
        return TrialMetrics("r", 1.0, 100, finished, 0, 0, 1.0, 1.0, 1.0, 1.0, 0.0, ttft, ttft, tpot, 1, 1, 0, 0)

    cases = {
        (0.25, 0.05, 100): 0.5,  # TTFT at half its limit, TPOT at half its SLO: 0.5
        (0.25, 0.09, 100): 0.9,
        (0.6, 0.05, 100): 1.2,
        (0.1, 0.2, 100): 2.0,
        (0.1, None, 99): 1.0,  # 1% unfinished is the share allowed: at the edge, still holding
        (0.1, 0.01, 97): 3.0,
    }
    for (ttft, tpot, finished), expected in cases.items():
        m = metrics(ttft, tpot, finished)
        assert pressure(m, slo) == pytest.approx(expected), (ttft, tpot, finished)
        assert (pressure(m, slo) > 1) == bool(breaches(m, slo)), (ttft, tpot, finished)
    assert pressure(metrics(None, None, 0), slo) == math.inf


def test_the_estimate_reads_where_the_slos_break_within_the_bracket() -> None:
    """The bracket's lower end moves in whole steps; the estimate interpolates the SLO pressure's crossing of 1
    in log-log between the ends (exact for a power law), and stays the lower end when the search never
    bracketed."""
    opts = WL.WorkloadOptions(requests=24, scale=8.0, output_range=(16, 64))
    reqs = WL.scenario("sustained", 6.0, opts, seed=1000)
    prompts = prepare_prompts(reqs, 1000)
    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=0.5)
    for true in (1.7, 2.3, 3.05):
        cap = replay_capacity(
            _PowerLaw({1000: true}), None, reqs, prompts, slo=slo, run_id="e-s1000", growth=1.15, rel_tol=0.15,
            max_replays=12,
        )  # fmt: skip
        assert cap.bracketed and cap.multiplier <= true < cap.upper
        # exact but for the fake reading the multiplier from the replay's run id (4 significant digits)
        assert cap.estimate == pytest.approx(true, rel=1e-3)
        assert cap.estimate_rps == pytest.approx(cap.estimate * arrival_rate(reqs))
        assert cap.summary()["estimate_rps"] == pytest.approx(cap.estimate_rps, abs=1e-4)
        assert all(p.pressure is not None and (p.pressure <= 1) == p.holds for p in cap.probes)
    unbracketed = replay_capacity(
        _PowerLaw({1000: 100.0}), None, reqs, prompts, slo=slo, run_id="u-s1000", max_replays=2
    )
    assert unbracketed.upper is None and unbracketed.estimate == unbracketed.multiplier == 2.0


def test_a_capacity_near_a_known_one_takes_two_replays_and_a_far_one_a_wide_search_after() -> None:
    """A confirmation searched from the running config's capacity (`near`): within a step of it, 2 replays and
    an estimate where the SLOs break; 60% over it, the short steps end unbracketed and a wide search from past
    them finds it; a wide search whose first rate the sender cannot send leaves the short one's bound."""
    from tuner.capacity import replay_capacity_near

    opts = WL.WorkloadOptions(requests=24, scale=8.0, output_range=(16, 64))
    reqs = WL.scenario("sustained", 6.0, opts, seed=1000)
    prompts = prepare_prompts(reqs, 1000)
    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=0.5)
    close = replay_capacity_near(_PowerLaw({1000: 2.3}), None, reqs, prompts, slo=slo, run_id="n-s1000", start=2.1)
    assert len(close.probes) == 2 and close.bracketed and close.estimate == pytest.approx(2.3, rel=1e-3)
    far = replay_capacity_near(_PowerLaw({1000: 3.4}), None, reqs, prompts, slo=slo, run_id="f-s1000", start=2.1)
    assert [p.holds for p in far.probes[:4]] == [True] * 4 and len(far.probes) > 4  # 2.1 .. 3.19 held
    assert far.bracketed and far.estimate == pytest.approx(3.4, rel=1e-3), far.summary()
    lagging = _PowerLaw({1000: 3.4}, late=lambda seed, m: m > 3.3)
    bound = replay_capacity_near(lagging, None, reqs, prompts, slo=slo, run_id="l-s1000", start=2.1)
    assert not bound.found and bound.multiplier == pytest.approx(2.1 * 1.15**3, rel=1e-3)
    assert bound.not_measured is not None and bound.not_measured.startswith("x6.388: the replay client sent late")


def test_an_aa_comparison_with_a_noisy_machine_reads_no_gain_from_its_estimates() -> None:
    """Bench run 6's A/A check read (29.9 x4), (32.6, 28.3, 32.6, 24.6), (25.5, 33.7, 29.3, 29.3): lower ends a
    15% step apart, log ratios of 0 or +-0.14, an interval of -4.7%..+20.6% that no pair budget narrows to a few
    percent. Measured by their estimates, the same config against itself on a machine whose capacity jitters 2%
    per measurement is `no gain` within a 3% margin, every pair's figures within the jitter of the truth."""
    from tuner.compare import ReplayerSide, compare

    opts = WL.WorkloadOptions(requests=24, scale=8.0, output_range=(16, 64))
    workloads = {seed: WL.scenario("sustained", 6.0, opts, seed=seed) for seed in (1000, 1001)}
    prompts = {seed: prepare_prompts(reqs, seed) for seed, reqs in workloads.items()}
    truth = {1000: 2.3, 1001: 3.3}
    fake = _PowerLaw(truth, noise=0.02, seed=7)
    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=0.5)

    def side(label: str) -> ReplayerSide:
        return ReplayerSide(label, fake, None, lambda seed: (workloads[seed], prompts[seed]), slo, "aa")

    aa = compare(side("running"), side("candidate"), seeds=[1000, 1001], start=3.0, floor_rps=0.01, max_pairs=6)
    assert aa.verdict == NO_GAIN and aa.lower_bounds == [], aa.as_dict()
    assert 1 / 1.03 <= aa.interval.low <= aa.interval.high <= 1.03
    for pair in aa.pairs:
        rate = arrival_rate(workloads[pair["seed"]])
        assert all(abs(math.log(c / rate / truth[pair["seed"]])) < 0.1 for c in (*pair["running"], *pair["candidate"]))
        abba = [pair["running"][0], *pair["candidate"], pair["running"][1]]
        assert all(held <= est for held, est in zip(pair["held"], abba, strict=True))  # lower ends under estimates


def test_a_measurement_the_sender_could_not_make_ends_the_comparison_inconclusive() -> None:
    """Bench run 9: a held-out measurement's first replay lagged in all 5 attempts and the whole bench stopped.
    The comparison now ends there, `inconclusive` with the reason, the pairs before it kept."""
    from tuner.compare import ReplayerSide, compare

    opts = WL.WorkloadOptions(requests=24, scale=8.0, output_range=(16, 64))
    workloads = {seed: WL.scenario("sustained", 6.0, opts, seed=seed) for seed in (1000, 1001)}
    prompts = {seed: prepare_prompts(reqs, seed) for seed, reqs in workloads.items()}
    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=0.5)
    fake = _PowerLaw({1000: 2.3, 1001: 3.3}, late=lambda seed, m: seed == 1001)

    def side(label: str) -> ReplayerSide:
        return ReplayerSide(label, fake, None, lambda seed: (workloads[seed], prompts[seed]), slo, "nm")

    said: list[str] = []
    c = compare(side("running"), side("candidate"), seeds=[1000, 1001], start=3.0, floor_rps=0.01, say=said.append)
    assert c.verdict == INCONCLUSIVE and len(c.pairs) == 1 and c.pairs[0]["seed"] == 1000
    assert c.not_measured == "pair 2, seed 1001: the replay client sent late in all 5 attempts"
    assert c.sentence().startswith("inconclusive: a measurement could not be made (pair 2, seed 1001")
    assert c.as_dict()["not_measured"] == c.not_measured and said[-1].startswith("pair 2 (seed 1001): inconclusive")


def test_a_short_search_whose_scout_the_sender_cannot_send_stays_a_bound() -> None:
    """The CI's tiny A/A check on the real vLLM: a short search held at both its rates, its scout's first rate
    (twice the last) was past what the sender sends on time. The short search's answer stands as a bound (the
    pair says "capacity not found"), not a measurement lost."""
    from tuner.compare import ReplayerSide, compare

    opts = WL.WorkloadOptions(requests=24, scale=8.0, output_range=(16, 64))
    workloads = {seed: WL.scenario("sustained", 6.0, opts, seed=seed) for seed in (1000, 1001)}
    prompts = {seed: prepare_prompts(reqs, seed) for seed, reqs in workloads.items()}
    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=0.5)
    # capacities far past what the sender reaches: it lags on every replay past x5
    fake = _PowerLaw({1000: 50.0, 1001: 50.0}, late=lambda seed, m: m > 5.0)

    def side(label: str) -> ReplayerSide:
        return ReplayerSide(label, fake, None, lambda seed: (workloads[seed], prompts[seed]), slo, "ss")

    c = compare(side("running"), side("candidate"), seeds=[1000, 1001], start=1.0, floor_rps=0.01)
    assert c.verdict == INCONCLUSIVE and c.not_measured is None and c.lower_bounds, c.as_dict()
    assert len(c.pairs) == 2 and c.unsent and c.unsent[0].startswith("seed 1000: x")
    assert c.sentence().startswith("inconclusive: capacity not found: the SLOs held at the largest rate measured")
    assert "could not be sent on time (seed 1000: x" in c.sentence() and c.as_dict()["unsent"] == c.unsent


class _DriftingSide:
    """A side on a machine whose speed drifts by `drift` (log) per measurement, whatever config is measured: the
    clock is shared, and every call is logged in order."""

    def __init__(self, label: str, multiplier: float, clock: list[str], *, drift: float, wobble=lambda n: 0.0):
        self.label, self.multiplier, self.clock, self.drift, self.wobble = label, multiplier, clock, drift, wobble
        self.calls = 0

    def capacity(self, *, seed: int, start: float, tag: str):
        from tuner.capacity import Capacity

        self.clock.append(self.label)
        self.calls += 1
        m = self.multiplier * math.exp(self.drift * len(self.clock) + self.wobble(self.calls))
        return Capacity(rate_rps=1.0, multiplier=m, upper=m * 1.15)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


def test_arms_share_rounds_nested_so_a_drift_cancels_in_each_and_a_decided_arm_leaves() -> None:
    """The held-out comparison and the A/A check in one set of rounds: A X1 X2 X2 X1 A, six measurements where
    two comparisons one after the other take eight. A machine slowing 3% per measurement cancels exactly in every
    arm (each arm's two sit symmetrically about the round's middle, as the running config's do): the A/A arm
    reads 1.000 and says `no gain`, the candidate's +20% reads +20.0%. An arm that has said leaves: the noisy
    candidate goes on alone, A B B A, until it says."""
    from tuner.compare import compare_arms

    clock: list[str] = []
    wobble = {3: 0.15, 4: 0.15}  # the candidate's calls in the second round read 15% high
    running = _DriftingSide("running", 3.0, clock, drift=-0.03)
    candidate = _DriftingSide("candidate", 3.6, clock, drift=-0.03, wobble=lambda n: wobble.get(n, 0.0))
    aa = _DriftingSide("aa", 3.0, clock, drift=-0.03)
    run = dict(seeds=[1000, 1001, 1002, 1003], start=3.0, floor_rps=0.01, min_pairs=2, max_pairs=4)
    heldout, check = compare_arms(running, [candidate, aa], **run)
    assert clock[:6] == ["running", "candidate", "aa", "aa", "candidate", "running"]
    assert clock[6:12] == ["candidate", "aa", "running", "running", "aa", "candidate"]  # the sides take turns
    assert check.pairs[1]["order"] == clock[6:12]
    assert [p["log_ratio"] for p in check.pairs] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert check.verdict == NO_GAIN and check.candidate == "aa" and len(check.pairs) == 2, check.as_dict()
    # the candidate's second round read +15% high: inconclusive at 2 pairs, so it went on, with the A/A arm gone
    assert clock[12:] == ["running", "candidate", "candidate", "running"] * (len(heldout.pairs) - 2)
    assert heldout.pairs[0]["log_ratio"] == pytest.approx(math.log(1.2), abs=1e-12)
    assert len(heldout.pairs) == 3 and heldout.verdict == PROPOSAL, heldout.as_dict()
    with pytest.raises(ValueError, match="labelled apart"):
        compare_arms(running, [aa, _DriftingSide("aa", 3.0, clock, drift=0.0)], **run)


class _DepthSide:
    """A side whose every measurement reads its config's capacity times a factor of its depth in the round's
    nesting (the count of measurements before it in the round, or after it if fewer): the outer ones fast, the
    inner ones slow, as bench run 21's A/A check read on fresh servers."""

    def __init__(self, label: str, clock: list[str], effect: dict[int, float]) -> None:
        self.label, self.clock, self.effect = label, clock, effect

    def capacity(self, *, seed: int, start: float, tag: str):
        from tuner.capacity import Capacity

        self.clock.append(self.label)
        pos = (len(self.clock) - 1) % 6
        m = 3.0 * math.exp(self.effect[min(pos, 5 - pos)])
        return Capacity(rate_rps=1.0, multiplier=m, upper=m * 1.15)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


def test_the_sides_take_every_depth_in_turn_so_a_depth_effect_cancels_over_the_rounds() -> None:
    """Three sides of one config on a machine where the outer measurements of a round read 5% high and the inner
    ones 5% low: each round's ratios carry the depth (-10% for the innermost arm in the first), and over three
    rounds each side has been at every depth once, so both arms' mean ratios are exactly 1."""
    from tuner.compare import compare_arms, rotation

    assert rotation(["a", "b", "c"], 0) == ["a", "b", "c"] and rotation(["a", "b", "c"], 4) == ["b", "c", "a"]
    clock: list[str] = []
    effect = {0: 0.05, 1: 0.0, 2: -0.05}
    sides = [_DepthSide(label, clock, effect) for label in ("running", "candidate", "aa")]
    run = dict(seeds=[1000, 1001, 1002], start=3.0, floor_rps=0.01, min_pairs=3, max_pairs=3)
    heldout, check = compare_arms(sides[0], sides[1:], **run)
    assert [p["log_ratio"] for p in check.pairs] == pytest.approx([-0.10, 0.05, 0.05])
    assert [p["log_ratio"] for p in heldout.pairs] == pytest.approx([-0.05, 0.10, -0.05])
    assert heldout.interval.ratio == pytest.approx(1.0) and check.interval.ratio == pytest.approx(1.0)
    assert [p["order"][:3] for p in check.pairs] == [
        ["running", "candidate", "aa"],
        ["candidate", "aa", "running"],
        ["aa", "running", "candidate"],
    ]


class _Instances:
    """Servers of one config whose instances differ: each instance's speed is the config's times its own factor,
    drawn when it starts (the first ones given), kept while it runs; every measurement on a shared noisy clock.
    `renew` restarts every side (the log says when)."""

    def __init__(self, rng: random.Random, spread: float, first: dict[str, float]) -> None:
        self.rng, self.spread, self.factor, self.log = rng, spread, dict(first), []

    def renew(self, i: int, labels: list[str]) -> None:
        assert sorted(labels) == sorted(self.factor)
        self.log.append(f"renew {i}")
        self.factor = {label: math.exp(self.rng.gauss(0.0, self.spread)) for label in self.factor}

    def side(self, label: str, multiplier: float) -> _InstanceSide:
        return _InstanceSide(self, label, multiplier)


class _InstanceSide:
    def __init__(self, servers: _Instances, label: str, multiplier: float) -> None:
        self.servers, self.label, self.multiplier, self.paused = servers, label, multiplier, True

    def capacity(self, *, seed: int, start: float, tag: str):
        from tuner.capacity import Capacity

        assert not self.paused
        self.servers.log.append(self.label)
        m = self.multiplier * self.servers.factor[self.label] * math.exp(self.servers.rng.gauss(0.0, 0.01))
        return Capacity(rate_rps=1.0, multiplier=m, upper=m * 1.15)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def test_an_instance_that_is_faster_for_as_long_as_it_runs_is_a_proposal_unless_each_pair_has_fresh_servers() -> None:
    """Bench run 17: the A/A check's second server of the running config beat its first by 8% in every pair,
    +8.1% (90% interval +2.4%..+14.0%), a `proposal` of nothing. Kept servers put one instance difference in
    every pair; fresh servers before every round (`renew`) draw new instances per pair, so the same 8% first
    draw is one pair among several and the check is not a proposal; every round starts on fresh servers, all
    paused until measured."""
    from tuner.compare import compare_arms

    run = dict(seeds=[1000, 1001, 1002, 1003, 1004], start=3.0, floor_rps=0.01, min_pairs=2, max_pairs=5)
    kept = _Instances(random.Random(4), 0.05, {"running": 1.0, "aa": 1.08})
    (stuck,) = compare_arms(kept.side("running", 3.0), [kept.side("aa", 3.0)], **run)
    assert stuck.verdict == PROPOSAL and stuck.interval.low > 1.03 and not stuck.fresh_servers, stuck.as_dict()

    fresh = _Instances(random.Random(4), 0.05, {"running": 1.0, "aa": 1.08})
    checks = [
        compare_arms(fresh.side("running", 3.0), [fresh.side("aa", 3.0)], renew=fresh.renew, **run)[0]
        for _ in range(20)
    ]
    rounds = [fresh.log[k : k + 5] for k in range(0, len(fresh.log), 5)]
    orders = (["running", "aa", "aa", "running"], ["aa", "running", "running", "aa"])
    assert all(r[0] == f"renew {k}" and r[1:] == orders[k % 2] for r in rounds for k in [int(r[0].split()[1])])
    assert sum(len(c.pairs) for c in checks) == len(rounds)  # one renewal per round, before its first measurement
    assert sum(c.verdict == PROPOSAL for c in checks) <= 2, [c.verdict for c in checks]  # 5% each side, nominally
    assert all(c.fresh_servers and "each on fresh servers" in c.sentence() for c in checks if len(c.pairs) >= 2)


def test_a_wait_at_the_client_is_in_the_ttft_users_saw() -> None:
    """A replay whose client held requests back (the server held its bound of unanswered requests): the p99 TTFT
    the search reads is at least the waits' p99, so the probe breaks the SLO the server's own rows would have
    met, with the count in the reason; nothing held back leaves the server's figures as they are."""
    from tuner.capacity import pressure
    from tuner.metrics import combine, with_client_wait

    slo = SLO(ttft_s=1.0, tpot_s=0.1, p99_ttft_s=2.0)
    served = TrialMetrics("r", 10.0, 500, 500, 0, 0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.3, 1.2, 0.05, 2.0, 4.0, 0, 0)
    assert with_client_wait(served, held_back=0, wait_p99_s=0.0) is served and not breaches(served, slo)
    held = with_client_wait(served, held_back=40, wait_p99_s=3.5)
    assert (held.held_back, held.ttft_p99_s, held.e2e_p99_s, held.ttft_p50_s) == (40, 3.5, 4.0, 0.3)
    assert breaches(held, slo) == ("p99 TTFT 3.5 s > 2 s (40 requests waited for a connection to the server first)",)
    assert pressure(held, slo) == pytest.approx(1.75)
    short = with_client_wait(served, held_back=3, wait_p99_s=0.0)  # fewer than 1% waited: the p99 is the server's
    assert short.ttft_p99_s == 1.2 and not breaches(short, slo) and combine([short, held]).held_back == 43
    with pytest.raises(ValueError, match="client wait: must be >= 0"):
        with_client_wait(served, held_back=-1, wait_p99_s=0.0)
