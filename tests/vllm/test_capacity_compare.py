"""SLO capacity and the live ABBA comparison on a real vLLM: the running config (the session's vLLM, attached)
gets a capacity from a tiny search, then the A/A check runs the running config against itself, each round on
fresh servers of ours (two started together per round: the attached one cannot be restarted), the idle one paused
while the other serves. The A/A check must not say `proposal`; every capacity is positive and what the replays'
SLO outcomes say (or, where a tiny search found none, the comparison says it found none)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from collector.db import make_engine
from integrations.vllm.config import VllmConfig
from tuner import workloads as WL
from tuner.capacity import breaches, requests_at
from tuner.compare import INCONCLUSIVE, PROPOSAL
from tuner.metrics import SLO
from tuner.vllm.backend import VllmBackend
from tuner.vllm.space import load_vllm_space
from tuner.vllm.tune import Budget, VllmTuning, checkpoint_model

pytestmark = pytest.mark.vllm

SLO_CAP = SLO(ttft_s=2.0, tpot_s=0.5, p99_ttft_s=2.0)


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _becomes(pid: int, stopped: bool, timeout_s: float = 5.0) -> bool:
    """Whether the process is (or is no longer) stopped within `timeout_s`: a signal takes effect when the kernel
    next schedules the process, not when kill() returns (a CI run read 'R' right after SIGSTOP)."""
    deadline = time.monotonic() + timeout_s
    while (_state(pid) == "T") != stopped:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.timeout(1200)  # two rounds of two vLLM starts together: 60-150 s each on 2 busy cores
def test_capacity_and_an_aa_comparison_on_real_vllm(vllm_peer, tmp_path, caplog) -> None:
    from tests.vllm.peer import ADMIN_TOKEN, KV_CACHE_BYTES, MODEL, TOKEN, vllm_python

    base = VllmConfig(model=str(vllm_peer.checkpoint), served_model_name=MODEL, kv_cache_memory_bytes=KV_CACHE_BYTES)
    opts = WL.WorkloadOptions(requests=10, scale=16.0, output_range=(4, 12), max_total_tokens=512)

    def workload(seed: int) -> list:
        return WL.scenario("mixed", 3.0, opts, seed=seed)

    caplog.set_level(logging.INFO, logger="kvpilot.tuner.capacity")  # each replay's SLO outcome, on a failure
    db = make_engine(vllm_peer.db_url)
    backend = VllmBackend(
        workload=workload,
        db=db,
        slo=SLO_CAP,
        python=vllm_python(),
        collector_url=vllm_peer.collector_url,
        ingest_token=TOKEN,
        admin_token=ADMIN_TOKEN,
        log_dir=tmp_path / "logs",
    )
    backend.attach(base, url=vllm_peer.url, run_id="vllm-session")
    tuning = VllmTuning(
        backend=backend,
        db=db,
        base=base,
        space=load_vllm_space(base=base),
        slo=SLO_CAP,
        budget=Budget(heldout_seeds=(1000, 1001), capacity_replays=2, pair_replays=2, min_pairs=2),
        model=checkpoint_model(vllm_peer.checkpoint, base.dtype),
        workload=workload,
        name="aa-test",
    )
    try:
        cap = tuning.baseline_capacity()
        assert 1 <= len(cap.probes) <= 2 and cap.capacity_rps > 0
        reqs, _ = backend.requests(tuning.budget.tuning_seeds[0])
        for probe in cap.probes:  # what each replay's stored rows say is what the search concluded; x2: 20 requests
            assert probe.holds == (breaches(probe.metrics, SLO_CAP) == ())
            assert probe.metrics.requests == requests_at(reqs, probe.multiplier) == round(10 * probe.multiplier)
        assert cap.multiplier == max(p.multiplier for p in cap.probes if p.holds)
        assert cap.upper is None or cap.upper == min(p.multiplier for p in cap.probes if not p.holds)
        aa = tuning.aa_check()
        first_round = [x for x in backend.launches if x.run_id.endswith("-r1")]
        assert [x.run_id for x in backend.launches] == [  # the launch order rotates by round
            "aa-test-running-r1", "aa-test-aa-r1", "aa-test-aa-r2", "aa-test-running-r2"
        ]  # fmt: skip
        assert all(x.ready_s is not None and x.stop_s is not None for x in first_round)  # stopped for round 2's
        # the second server is ours: pausing stops its whole process group, resuming continues it
        server = backend._servers[("aa", *base.to_args())]
        pid = server.launcher.proc.pid
        # its API server and engine core run off the cores its model worker bound, and so did the replays' sender
        placement = server.launch.placement
        assert placement is not None and placement.describe().startswith("model worker on cores"), server.launch
        assert (
            placement.worker_cpus.isdisjoint(placement.other_cpus) and os.sched_getaffinity(pid) == placement.other_cpus
        )
        assert backend.last_client is not None and backend.last_client.sender_cpus == sorted(placement.other_cpus)
        assert backend.pause(base, "aa") and _becomes(pid, stopped=True), _state(pid)
        assert backend.resume(base, "aa") and _becomes(pid, stopped=False), _state(pid)
        assert not backend.pause(base)  # the attached vLLM is not ours to stop
    finally:
        backend.close()
        db.dispose()
    assert aa.verdict != PROPOSAL, aa.as_dict()
    assert all(p["replays"] >= 4 for p in aa.pairs)
    assert (
        backend.restart_costs()["launches"] == backend.restart_costs()["isolated"] == 4
        and backend.stale_targets == []
        and aa.fresh_servers
    )
    if aa.not_measured is not None:
        # A loaded 2-core machine whose sender could not send a round's first replay on time in 5 attempts (seen
        # once in CI): the comparison ends inconclusive saying so, with the pair measured before (if any).
        assert aa.verdict == INCONCLUSIVE and "sent late" in aa.not_measured and len(aa.pairs) <= 1, aa.as_dict()
        assert "could not be made" in aa.sentence()
        return
    if any(c <= 0 for p in aa.pairs for c in (*p["running"], *p["candidate"])):
        # A search that failed the SLOs at every rate its tiny budget tried (2 + 2 replays down to a quarter of
        # the prior; seen once in CI, each replay's outcome in the log): a bound, not a capacity, and the
        # comparison must say so rather than conclude from it.
        assert aa.verdict == INCONCLUSIVE and 0.0 in aa.lower_bounds, json.dumps(aa.pairs)
        assert "capacity not found" in aa.sentence(), aa.sentence()
    assert len(aa.pairs) == 2
    assert aa.interval is not None and aa.interval.low <= aa.interval.ratio <= aa.interval.high
