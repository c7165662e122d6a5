"""`kvpilot loadtest --api openai` against the session's vLLM: its pass criteria read vLLM's /metrics through
the collector's mapping, so `no_oom` and `util_stable` are judged on figures vLLM has, and say which."""

from __future__ import annotations

import pytest

from kvpilot.loadtest.session import LoadTestSpec, run_loadtest
from tests.vllm.peer import VllmPeer

pytestmark = pytest.mark.vllm


def test_loadtest_openai_on_vllm_judges_no_oom_and_util_on_vllms_own_series(vllm_peer: VllmPeer) -> None:
    spec = LoadTestSpec(
        scenario="mixed",
        target=vllm_peer.url,
        duration_s=12.0,  # two 6-s windows: each sees vLLM step under a scrape even on a loaded CI machine
        rate=2.0,
        length_scale=8.0,
        output_scale=8.0,
        max_total_tokens=400,  # the peer serves 512 tokens
        api="openai",
        windows=2,
        timeout_s=60.0,
        progress=False,
    )
    report = run_loadtest(spec)
    assert report["requests_answered"] == report["requests_sent"] > 0, report["errors_sample"]
    oom, util = report["criteria"]["no_oom"], report["criteria"]["util_stable"]
    # vLLM has no OOM counter: preemptions are its KV-exhaustion signal (a light load on 64 blocks makes none)
    assert oom["basis"] == "preemptions_total" and "vllm:num_preemptions_total" in oom["detail"], oom
    assert (oom["passed"], oom["value"]) == (True, 0), oom
    # no utilization gauge either: requests running, over scrapes where vLLM's iteration count moved
    assert util["basis"] == report["util_signal"] == "running", util
    assert "vllm:num_requests_running" in util["detail"]
    assert util["value"] is not None and util["value"] >= 0, util
    assert sum(w["utilization"] is not None for w in report["windows"]) == 2
    assert report["preemptions"] == 0 and report["scrapes"] > 0
