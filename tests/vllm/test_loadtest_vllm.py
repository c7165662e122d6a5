"""`kvpilot loadtest --api openai` against the session's vLLM: its pass criteria read vLLM's /metrics through
the collector's mapping, so `no_oom` and `util_stable` are judged on figures vLLM has, and say which."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from collector.scraper import parse_exposition
from kvpilot.loadtest.analysis import analyze
from kvpilot.loadtest.client import ClientOptions
from kvpilot.loadtest.plan import PlanOptions, plan_mixed
from kvpilot.loadtest.runner import RunOptions, run_load
from kvpilot.loadtest.session import LoadTestSpec, run_loadtest
from tests.vllm.peer import MODEL, VllmPeer

pytestmark = pytest.mark.vllm


def test_loadtest_openai_on_vllm_judges_no_oom_and_util_on_vllms_own_series(vllm_peer: VllmPeer) -> None:
    spec = LoadTestSpec(
        scenario="mixed",
        target=vllm_peer.url,
        duration_s=12.0,  # two 6-s windows: each sees vLLM step under a scrape even on a loaded CI machine
        rate=2.0,
        length_scale=8.0,
        # 16-256 output tokens: requests long enough to be running when a 0.5-s scrape lands (at 4-64 a
        # loaded CI machine once read 0 running in every scrape of both windows)
        output_scale=2.0,
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


def _token_counters(url: str) -> dict[str, float]:
    """vLLM's own prompt and generation token counters, summed over their label sets."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    totals = dict.fromkeys(("vllm:prompt_tokens_total", "vllm:generation_tokens_total"), 0.0)
    for name, _labels, value in parse_exposition(text):
        if name in totals:
            totals[name] += value
    return totals


def test_openai_loadtest_sends_the_planned_tokens_and_takes_vllms_own_counts(vllm_peer: VllmPeer) -> None:
    """Prompts as vLLM's own token ids are exactly the planned length (text made 24% fewer tokens with its BPE
    tokenizer); output tokens come from vLLM's `usage` (counting chunks came out 11% low) and, with
    `ignore_eos`, are exactly what was planned; both agree with vLLM's own counters."""
    plan = plan_mixed(
        PlanOptions(duration_s=6.0, rate=2.0, seed=5, length_scale=8.0, output_scale=8.0, max_total_tokens=400)
    )
    before = _token_counters(vllm_peer.url)
    client = ClientOptions(api="openai", timeout_s=60.0, run_id="lt-tokens", model=MODEL)
    run = asyncio.run(run_load(vllm_peer.url, plan, RunOptions(client=client, progress=False)))
    ok = [r for r in run.results if r.outcome == "ok"]
    assert len(ok) == len(plan) > 5, [r.error for r in run.results if r.outcome != "ok"][:3]
    assert run.prompt_form.startswith("token_ids"), run.prompt_form
    assert [r.served_prompt_tokens for r in ok] == [r.prompt_tokens for r in ok]
    assert all(r.server_counted for r in ok)
    assert [r.output_tokens for r in ok] == [r.max_tokens for r in ok]  # ignore_eos honoured
    served = {"vllm:prompt_tokens_total": sum(r.prompt_tokens for r in ok)}
    served["vllm:generation_tokens_total"] = sum(r.output_tokens for r in ok)
    deadline = time.monotonic() + 15.0  # vLLM records a request's counts as its output is handed over
    while (counted := {k: v - before[k] for k, v in _token_counters(vllm_peer.url).items()}) != served:
        assert time.monotonic() < deadline, (counted, served)
        time.sleep(0.5)
    report = analyze(run, span_s=6.0, windows=2)
    tokens = report["tokens"]
    assert tokens["output_counted_by"] == "server" and tokens["prompt_served"] == tokens["prompt_planned"]
    assert tokens["output_served"] == tokens["output_planned"] == served["vllm:generation_tokens_total"]
