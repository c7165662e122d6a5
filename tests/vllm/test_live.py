"""A real vLLM (CPU build) started by `kvpilot vllm serve`, its telemetry in the collector's database.

Every test shares the session's one vLLM (`vllm_peer`, tests/vllm/peer.py). The invariant checked after
each: the `steps` table holds exactly one row per iteration line in vLLM's raw output.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import random
import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from engine.sinks import NullSink
from tests.vllm.peer import INSTANCE, LABELS, MODEL, TOKEN, VllmPeer

pytestmark = pytest.mark.vllm

WORDS = [
    "cache",
    "block",
    "queue",
    "token",
    "batch",
    "prefill",
    "decode",
    "step",
    "engine",
    "memory",
    "request",
    "tenant",
    "latency",
    "budget",
]


def prompt(seed: int, words: int) -> str:
    """Distinct prompts, so vLLM's prefix cache never skips a prefill the test counts."""
    rng = random.Random(seed)
    return f"request {seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def test_completions_become_one_step_row_per_iteration_line(vllm_peer: VllmPeer) -> None:
    vllm_peer.wait_steps_stored()  # an earlier test's steps still on their way are not this test's
    before = vllm_peer.query("SELECT coalesce(max(id), 0) FROM steps WHERE instance = :i", i=INSTANCE)[0][0]
    jobs = [(100 + i, 15 + 40 * i, 6 + 3 * i) for i in range(5)]  # (seed, prompt words, output tokens)
    with httpx.Client() as client, cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: vllm_peer.complete(client, prompt(j[0], j[1]), j[2]), jobs))
    stored, lines = vllm_peer.wait_steps_stored()
    assert stored == lines > 0, f"{stored} steps stored for {lines} iteration lines {vllm_peer.where()}"

    rows = vllm_peer.query(
        "SELECT step, num_seqs, prefill_tokens, decode_tokens, duration_s, forward_s, busy_s, kv_blocks_used,"
        " kv_blocks_total, queue_depth, warmup, run_id FROM steps WHERE instance = :i AND id > :b ORDER BY id",
        i=INSTANCE,
        b=before,
    )
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    output_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    assert output_tokens == sum(j[2] for j in jobs)
    # every prompt token is prefilled once; the prefill step makes each request's first token, decode the rest
    assert sum(r.prefill_tokens for r in rows) == prompt_tokens
    assert sum(r.decode_tokens for r in rows) == output_tokens - len(jobs)
    assert max(r.num_seqs for r in rows) >= 2  # continuous batching ran requests together
    assert all(r.duration_s == r.forward_s == r.busy_s and 0 < r.duration_s < 60 for r in rows)
    # 16 MiB of KV = 64 blocks of 128 tokens (read from vllm:cache_config_info); the longest request alone
    # held its tokens' blocks (how many requests overlapped depends on the host's speed, not on the mapping)
    assert {r.kv_blocks_total for r in rows} == {64}
    longest = max(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in results)
    assert max(r.kv_blocks_used for r in rows) >= math.ceil(longest / 128)
    assert {(r.queue_depth, r.warmup, r.run_id) for r in rows} == {(0, False, "vllm-session")}
    steps = [r.step for r in rows]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # vLLM's iteration index, none missing


def test_vllm_greedy_tokens_equal_kvpilot_engine_on_the_same_checkpoint(vllm_peer: VllmPeer) -> None:
    text = "The scheduler preempts the newest request when the KV cache is full."
    with httpx.Client() as client:
        out = vllm_peer.complete(client, text, 12, return_token_ids=True)["choices"][0]
    cfg = EngineConfig.from_dict(
        {"device": "cpu", "model": {"checkpoint": str(vllm_peer.checkpoint)}, "warmup": {"requests": 0}}
    )
    engine = LLMEngine(cfg, sink=NullSink())
    assert engine.tokenizer.encode(text) == out["prompt_token_ids"]
    ours = engine.generate([text], SamplingParams(max_tokens=12, ignore_eos=True))[0].output_token_ids
    assert ours == out["token_ids"]
    assert vllm_peer.wait_steps_stored() == (vllm_peer.iteration_lines(),) * 2


def test_metrics_target_is_registered_and_its_series_stored_with_their_labels(vllm_peer: VllmPeer) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=5.0) as client:
        while True:
            targets = client.get(f"{vllm_peer.collector_url}/v1/targets", headers=headers).json()
            ours = [t for t in targets if t["url"] == f"{vllm_peer.url}/metrics"]
            if (ours and ours[0]["up"]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert len(ours) == 1, (targets, vllm_peer.where())
    target = ours[0]
    assert (target["job"], target["instance"], target["labels"], target["interval_s"]) == (
        "vllm",
        INSTANCE,
        LABELS,
        1.0,
    )
    assert target["up"] is True and target["last_error"] is None, target
    while True:
        rows = vllm_peer.query(
            "SELECT name, labels FROM series_points WHERE instance = :i AND name IN ('kv_usage', 'running')",
            i=INSTANCE,
        )
        if {r.name for r in rows} == {"kv_usage", "running"} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {r.name for r in rows} == {"kv_usage", "running"}, vllm_peer.where()
    assert {r.labels for r in rows} == {
        json.dumps({"engine": "0", "model_name": MODEL, **LABELS}, sort_keys=True, separators=(",", ":"))
    }


def test_steps_made_while_the_collector_is_down_arrive_once_it_is_back(vllm_peer: VllmPeer) -> None:
    assert vllm_peer.wait_steps_stored() == (vllm_peer.iteration_lines(),) * 2
    stored_before = vllm_peer.stored_steps()
    vllm_peer.stop_collector()
    try:
        lines_before = vllm_peer.iteration_lines()
        with httpx.Client() as client:
            for i in range(3):
                vllm_peer.complete(client, prompt(200 + i, 30), 8)
        made = vllm_peer.settled_lines() - lines_before
        assert made == 3 * 8  # one after the other: a prefill step and seven decode steps each
        spool = next(vllm_peer.spool_dir.iterdir())
        deadline = time.monotonic() + 30
        while not list(spool.glob("*.batch")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(spool.glob("*.batch")), f"nothing spooled while the collector was down {vllm_peer.where()}"
    finally:
        vllm_peer.start_collector()
    stored, lines = vllm_peer.wait_steps_stored(timeout_s=90)
    assert stored == lines == stored_before + made, vllm_peer.where()
    assert not list(spool.glob("*.batch"))


def _vllm_finished_total(peer: VllmPeer) -> float:
    """vLLM's own count of finished requests (every finished_reason), from its /metrics."""
    text = httpx.get(f"{peer.url}/metrics", timeout=10.0).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total{")
    )


def test_request_spans_become_request_rows_as_many_as_vllm_counted(vllm_peer: VllmPeer) -> None:
    """vLLM's OTLP `llm_request` spans -> POST /v1/traces -> one request row each, with its stage timings."""
    counted_before = _vllm_finished_total(vllm_peer)
    jobs = [(300 + i, 10 + 15 * i, 4 + 2 * i) for i in range(6)]
    with httpx.Client() as client, cf.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda j: vllm_peer.complete(client, prompt(j[0], j[1]), j[2]), jobs))
    sent = {r["id"]: r for r in results}
    deadline = time.monotonic() + 60  # vLLM's span processor exports in batches every few seconds
    while True:
        rows = vllm_peer.query(
            "SELECT request_id, status, prompt_tokens, output_tokens, queue_s, prefill_s, ttft_s, decode_s, e2e_s,"
            " run_id FROM requests WHERE instance = :i",
            i=INSTANCE,
        )
        ours = {r.request_id: r for r in rows if any(r.request_id.startswith(rid) for rid in sent)}
        if len(ours) >= len(sent) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    counted = _vllm_finished_total(vllm_peer) - counted_before
    assert len(ours) == len(sent) == counted, (len(ours), len(sent), counted, vllm_peer.where())
    for request_id, row in ours.items():
        response = next(r for rid, r in sent.items() if request_id.startswith(rid))
        assert (row.status, row.run_id) == ("finished", "vllm-session")
        assert row.prompt_tokens == response["usage"]["prompt_tokens"]
        assert row.output_tokens == response["usage"]["completion_tokens"]
        assert 0 < row.ttft_s <= row.e2e_s
        # The stages are the engine core's and fit inside e2e; what e2e adds is the API server's input processing
        # before the queue (tens of ms on a loaded machine), which TTFT carries too, so decode is what e2e adds to TTFT.
        assert row.queue_s + row.prefill_s + row.decode_s <= row.e2e_s + 0.002, row
        assert row.queue_s + row.prefill_s <= row.ttft_s + 0.002, row
        assert abs((row.e2e_s - row.ttft_s) - row.decode_s) <= 0.05 * row.e2e_s + 0.02, row
