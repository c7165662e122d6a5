"""Each fault end to end against real local processes (engine, collector, alert evaluator, receiver)."""

from __future__ import annotations

import pytest

from kvpilot.loadtest.faults import run_fault
from kvpilot.loadtest.session import LoadTestSpec


def _spec(duration_s: float = 6.0) -> LoadTestSpec:
    return LoadTestSpec(
        scenario="mixed", duration_s=duration_s, rate=6.0, length_scale=8.0, output_scale=8.0, windows=3, progress=False
    )


def _assert_nothing_lost(report: dict) -> None:
    failing = {k: v["detail"] for k, v in report["fault"]["checks"].items() if not v["passed"]}
    assert not failing, failing
    assert report["passed"] is True
    assert report["requests_sent"] == report["requests_answered"] + report["requests_refused"] > 0


@pytest.mark.timeout(120)
def test_collector_killed_and_restarted() -> None:
    report = run_fault("collector-restart", _spec())
    _assert_nothing_lost(report)
    checks = report["fault"]["checks"]
    assert checks["loadtest_results_stored_once"]["stored"] == report["requests_sent"]
    assert checks["engine_request_events_once"]["stored"] == report["requests_sent"]
    assert checks["engine_events_stored_once"]["stored"] == checks["engine_events_stored_once"]["acknowledged"] > 0
    assert [a["action"] for a in report["actions"]] == ["collector SIGKILL", "collector restarted"]


@pytest.mark.timeout(150)
def test_webhook_receiver_down() -> None:
    report = run_fault("webhook-down", _spec())
    _assert_nothing_lost(report)
    delivered = report["fault"]["checks"]["alerts_delivered_once"]
    assert delivered["notifications"] >= 2 and delivered["receipts"] == delivered["notifications"]
    assert delivered["failed_attempts"] > 0


@pytest.mark.timeout(120)
def test_kv_pool_exhausted_by_a_burst() -> None:
    report = run_fault("kv-exhaustion", _spec(5.0))
    _assert_nothing_lost(report)
    assert report["fault"]["oom_events"] + report["fault"]["preemptions"] > 0
    assert report["criteria"]["no_oom"]["passed"] is False  # the seed criterion sees the OOM and says so


@pytest.mark.timeout(120)
def test_slow_client() -> None:
    report = run_fault("slow-client", _spec(5.0))
    _assert_nothing_lost(report)
    assert report["fault"]["slow_clients"] > 0
