from __future__ import annotations

import asyncio
import time

import pytest

from kvpilot.loadtest.analysis import analyze, counter_increase, fluctuation
from kvpilot.loadtest.client import ClientOptions, RequestResult
from kvpilot.loadtest.plan import PlannedRequest
from kvpilot.loadtest.report import render_table
from kvpilot.loadtest.runner import RunOptions, RunResult, TimedAction, run_load
from kvpilot.loadtest.scrape import MetricsSample, parse_metrics, read_metrics


def _plan(n: int, spacing: float = 0.01) -> list[PlannedRequest]:
    return [PlannedRequest(i, i * spacing, 10 + i % 7, 5) for i in range(n)]


def test_open_loop_outcomes_against_a_misbehaving_target(fake_engine: tuple[str, dict]) -> None:
    url, state = fake_engine
    kinds = {0: "429", 1: "500", 2: "hang", 3: "cut"}
    state["behaviour"] = lambda body: kinds.get(int(body["request_id"].rsplit("-", 1)[1]) % 10, "ok")
    opts = RunOptions(client=ClientOptions(timeout_s=1.5, run_id="t"), progress=False, scrape_interval_s=0.1)
    started = time.monotonic()
    run = asyncio.run(run_load(url, _plan(40), opts))
    assert time.monotonic() - started < 10  # the hung requests ended at their timeout
    by = {r.index: r for r in run.results}
    assert len(by) == 40 and state["requests"] == 40
    assert {by[i].outcome for i in range(0, 40, 10)} == {"refused"}
    assert {by[i].http_status for i in range(1, 40, 10)} == {500}
    assert {by[i].outcome for i in range(2, 40, 10)} == {"timeout"}
    assert {by[i].outcome for i in range(3, 40, 10)} == {"error"}
    ok = [r for r in run.results if r.outcome == "ok"]
    assert len(ok) == 24 and all(r.output_tokens == 5 and r.ttft_s is not None for r in ok)
    report = analyze(run, span_s=0.4, windows=2)
    assert report["requests_refused"] == 4 and report["requests_failed"] == 8 and report["requests_timed_out"] == 4
    assert report["criteria"]["no_errors"]["passed"] is False
    assert report["passed"] is False
    assert report["oom_events"] == 0


def test_oom_on_the_target_fails_the_run(fake_engine: tuple[str, dict]) -> None:
    url, state = fake_engine

    async def go() -> RunResult:
        async def bump() -> None:
            await asyncio.sleep(0.3)
            state["oom"] = 3

        task = asyncio.create_task(bump())
        run = await run_load(url, _plan(60, 0.01), RunOptions(progress=False, scrape_interval_s=0.1))
        await task
        return run

    report = analyze(asyncio.run(go()), span_s=0.6, windows=2)
    assert report["oom_events"] == 3
    assert report["criteria"]["no_oom"]["passed"] is False
    assert report["requests_answered"] == 60


def _result(i: int, t: float, e2e: float) -> RequestResult:
    r = RequestResult(
        i,
        f"r-{i}",
        "medium",
        10,
        5,
        scheduled_s=t,
        start_s=t,
        end_s=t + e2e,
        outcome="ok",
        output_tokens=5,
        ttft_s=e2e / 5,
    )
    return r


def _samples(utils: list[float], dt: float = 1.0) -> list[MetricsSample]:
    return [
        MetricsSample(i * dt, {"utilization": u, "steps_total": float(i), "oom_total": 0.0})
        for i, u in enumerate(utils)
    ]


@pytest.mark.parametrize(("last_e2e", "stable"), [(0.11, True), (0.13, False), (0.07, False)])
def test_p99_drift_criterion(last_e2e: float, stable: bool) -> None:
    results = [_result(i, i * 0.1, 0.1) for i in range(50)] + [
        _result(50 + i, 5 + i * 0.1, last_e2e) for i in range(50)
    ]
    run = RunResult(results, _samples([0.8] * 11), 0.0, 10.0, 10.0)
    report = analyze(run, span_s=10.0, windows=2, metric="e2e")
    assert report["p99_drift"] == pytest.approx((last_e2e - 0.1) / 0.1, abs=1e-3)
    assert report["criteria"]["p99_stable"]["passed"] is stable
    assert report["passed"] is stable


def test_utilization_fluctuation_is_cv_of_window_means() -> None:
    results = [_result(i, i * 0.1, 0.1) for i in range(100)]
    steady = analyze(RunResult(results, _samples([0.8, 0.82, 0.79, 0.81] * 3), 0.0, 12.0, 10.0), span_s=10.0)
    assert steady["util_fluctuation"] < 0.15 and steady["criteria"]["util_stable"]["passed"]
    assert steady["util_fluctuation_method"] == "cv"
    swing = [0.9] * 6 + [0.3] * 6
    report = analyze(RunResult(results, _samples(swing), 0.0, 12.0, 10.0), span_s=10.0, windows=2)
    # window 1 averages the stepping scrapes at t=1..4 (0.9), window 2 those at t=5..11 (0.9 once, 0.3 six times)
    windows = [0.9, (0.9 + 6 * 0.3) / 7]
    assert report["util_fluctuation"] == pytest.approx(fluctuation(windows), abs=1e-3)
    assert report["util_fluctuation"] == pytest.approx(0.4, abs=1e-3)
    assert report["criteria"]["util_stable"]["passed"] is False


def test_unmeasured_criteria_fail_with_a_reason() -> None:
    results = [_result(i, i * 0.1, 0.1) for i in range(100)]
    report = analyze(RunResult(results, [], 0.0, 10.0, 10.0), span_s=10.0)
    assert report["criteria"]["no_oom"]["passed"] is False
    assert "not exposed" in report["criteria"]["no_oom"]["detail"]
    assert report["criteria"]["util_stable"]["passed"] is False


def test_helpers() -> None:
    samples = [MetricsSample(i, {"oom_total": v}) for i, v in enumerate([0, 2, 5, 1, 3])]  # reset after 5
    assert counter_increase(samples, "oom_total") == 5 + 1 + 2
    text = (
        "# TYPE kvpilot_oom counter\nkvpilot_oom_total 4.0\n# TYPE kvpilot_utilization gauge\nkvpilot_utilization 0.5\n"
    )
    assert parse_metrics(text) == {"oom_total": 4.0, "utilization": 0.5}


# Two data-parallel engines, as vLLM 0.32 labels them (engine, model_name), plus what the mapping skips.
VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.2
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 0.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 30.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 40.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 900.0
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 30.0
vllm:iteration_tokens_total_sum{engine="1",model_name="m"} 500.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0
"""


def test_a_vllm_exposition_reads_through_the_collectors_mapping() -> None:
    reading = read_metrics(VLLM_METRICS)
    # counts summed over the engines, ratios averaged; steps are the iteration histogram's count
    assert reading.values == pytest.approx(
        {"running": 5.0, "queue_depth": 1.0, "kv_usage": 0.3, "preemptions_total": 2.0, "steps_total": 70.0}
    )
    assert reading.sources == {"vllm"}


def _vllm_samples(running: list[float], preempted: list[float]) -> list[MetricsSample]:
    return [
        MetricsSample(i, {"running": r, "steps_total": 10.0 * i, "preemptions_total": p}, frozenset({"vllm"}))
        for i, (r, p) in enumerate(zip(running, preempted, strict=True))
    ]


def test_a_vllm_target_is_judged_on_preemptions_and_running_requests_and_says_so() -> None:
    results = [_result(i, i * 0.1, 0.1) for i in range(100)]
    samples = _vllm_samples([4.0, 4.1, 3.9, 4.0, 4.0, 4.1, 3.9, 4.0, 4.0, 4.0, 4.0], [0.0] * 11)
    report = analyze(RunResult(results, samples, 0.0, 10.0, 10.0), span_s=10.0, windows=2)
    oom, util = report["criteria"]["no_oom"], report["criteria"]["util_stable"]
    assert (oom["passed"], oom["value"], oom["basis"]) == (True, 0, "preemptions_total")
    assert "no OOM counter" in oom["detail"] and "vllm:num_preemptions_total" in oom["detail"]
    assert (util["passed"], util["basis"], report["util_signal"]) == (True, "running", "running")
    assert "vllm:num_requests_running" in util["detail"]
    assert "requests running" in report["util_fluctuation_method_detail"]
    preempting = _vllm_samples([4.0] * 11, [0.0] * 5 + [3.0] * 6)
    report = analyze(RunResult(results, preempting, 0.0, 10.0, 10.0), span_s=10.0, windows=2)
    assert (report["criteria"]["no_oom"]["passed"], report["criteria"]["no_oom"]["value"]) == (False, 3)


def test_an_engine_stepping_while_every_scrape_reads_zero_running_says_so() -> None:
    results = [_result(i, i * 0.1, 0.1) for i in range(100)]
    report = analyze(RunResult(results, _vllm_samples([0.0] * 11, [0.0] * 11), 0.0, 10.0, 10.0), span_s=10.0, windows=2)
    util = report["criteria"]["util_stable"]
    assert (util["passed"], util["value"]) == (False, None)
    assert "read 0 in every scrape that saw the engine step, in all 2 windows" in util["detail"]


def test_a_kvpilot_target_keeps_its_own_names() -> None:
    results = [_result(i, i * 0.1, 0.1) for i in range(100)]
    report = analyze(RunResult(results, _samples([0.8] * 11), 0.0, 10.0, 10.0), span_s=10.0)
    assert report["criteria"]["no_oom"]["basis"] == "oom_total"
    assert report["criteria"]["util_stable"]["basis"] == "utilization" == report["util_signal"]


def test_a_client_that_sends_late_says_its_figures_do_not_count(fake_engine: tuple[str, dict]) -> None:
    """The client's own lateness is measured: its event loop blocked for 0.8 s (as a client on an overloaded
    machine is) sends the requests planned meanwhile late, and the run says its figures do not count."""
    url, _state = fake_engine

    async def block_the_client() -> None:
        time.sleep(0.8)  # blocking on purpose: nothing else on the client's loop runs meanwhile

    opts = RunOptions(progress=False, scrape_interval_s=0.1)
    plan = _plan(40, 0.03)  # 1.2 s of arrivals; those planned in [0.1, 0.9) s wait for the loop
    late_run = asyncio.run(run_load(url, plan, opts, actions=[TimedAction(0.1, "block", block_the_client)]))
    late = analyze(late_run, span_s=1.2, windows=2)
    lateness = late["client_lateness"]
    assert lateness["count"] == 40 and lateness["p99_s"] >= 0.6, lateness
    assert late["criteria"]["client_on_time"]["passed"] is False and late["figures_count"] is False
    assert late["passed"] is False
    assert "figures do not count" in late["criteria"]["client_on_time"]["detail"]
    assert "FIGURES DO NOT COUNT" in render_table({**late, "scenario": "mixed", "rate_per_s": 50.0})

    on_time = analyze(asyncio.run(run_load(url, plan, opts)), span_s=1.2, windows=2)
    assert on_time["client_lateness"]["count"] == 40
    assert on_time["client_lateness"]["p99_s"] < lateness["p99_s"] - 0.4  # the block, not the machine, made it late
    assert on_time["figures_count"] is on_time["criteria"]["client_on_time"]["passed"]
