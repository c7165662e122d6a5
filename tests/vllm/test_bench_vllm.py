"""`kvpilot bench vllm`'s quick path on the session's vLLM (already wired by `kvpilot vllm serve`): a tiny mixed
load, then what the collector stored against what was sent, what vLLM counted and its iteration lines.
The overhead half needs two vLLMs the bench starts itself; here it is left out, and the JSON says why."""

from __future__ import annotations

import pytest

from benchmarks.vllm_bench import Shape, run_vllm_bench
from benchmarks.vllm_readback import Wired
from collector.db import make_engine
from tests.vllm.peer import INSTANCE, LABELS, MODEL, VllmPeer

pytestmark = pytest.mark.vllm

KEYS = (
    "requests_sent",
    "requests_stored",
    "vllm_requests_total",
    "steps_stored",
    "iteration_lines",
    "stage_sum_error",
    "series_labels",
    "observability_overhead",
)


def test_bench_vllm_on_the_session_vllm_stores_what_was_sent_and_what_vllm_counted(vllm_peer: VllmPeer) -> None:
    db = make_engine(vllm_peer.db_url)
    wired = Wired(vllm_peer.url, MODEL, db, INSTANCE, "vllm-session", vllm_peer.vllm_log)
    try:
        shape = Shape(mixed_s=4.0, mixed_rate=2.0, reps=0, max_total_tokens=400)  # the peer serves 512 tokens
        result = run_vllm_bench(quick=True, wired=wired, shape=shape, progress=lambda msg: None)
    finally:
        db.dispose()
    assert all(key in result for key in KEYS), sorted(result)
    assert result["checks"]["settled"], (result, vllm_peer.where())
    assert result["mixed_load"]["failed"] == 0
    assert result["requests_sent"] == result["requests_stored"] == result["vllm_requests_total"] > 0, result
    assert result["steps_stored"] == result["iteration_lines"] > 0, result
    # every stored request has its stages; what they leave out of e2e is vLLM's input processing and output
    # handoff, tens of ms at most on a busy machine, which is a large share only of the shortest requests
    assert result["stage_sum"]["rows"] == result["requests_stored"]
    assert 0.0 <= result["stage_sum"]["median_error"] <= result["stage_sum_error"] < 1.0, result["stage_sum"]
    assert result["stage_sum"]["max_gap_s"] < 0.25, result["stage_sum"]
    labels = {"engine": "0", "model_name": MODEL, **LABELS}
    assert result["series_labels"]["running"] == result["series_labels"]["kv_usage"] == [labels]
    assert result["observability_overhead"] is None and result["observability_overhead_skipped"]
