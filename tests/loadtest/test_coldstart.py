from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.loadtest.client import ClientOptions
from kvpilot.loadtest.coldstart import measure_cold_start
from kvpilot.loadtest.local import TINY_ENGINE
from kvpilot.loadtest.plan import PlanOptions, plan_mixed
from kvpilot.loadtest.runner import RunOptions


@pytest.mark.timeout(120)
def test_cold_start_compares_fresh_engines(tmp_path: Path) -> None:
    plan = plan_mixed(PlanOptions(duration_s=10.0, rate=4.0, length_scale=8.0, output_scale=8.0, max_total_tokens=1000))
    report = measure_cold_start(
        TINY_ENGINE,
        plan,
        RunOptions(client=ClientOptions(run_id="cs")),
        requests=12,
        warmup_requests=4,
        workdir=tmp_path,
    )
    assert report["requests"] == 12
    assert report["without_warmup"]["warmup_requests"] == 0 and report["with_warmup"]["warmup_requests"] == 4
    for side in ("without_warmup", "with_warmup"):
        assert report[side]["answered"] == 12 and report[side]["not_answered"] == 0
        assert report[side]["e2e_s"]["p99"] >= report[side]["e2e_s"]["p50"] > 0
    assert report["p99_e2e_ratio"] == pytest.approx(
        report["without_warmup"]["e2e_s"]["p99"] / report["with_warmup"]["e2e_s"]["p99"], abs=1e-3
    )
