"""Tuning a real vLLM: the search space against vLLM's own parser, the proposal file read by vLLM, and a tiny
study end to end (trial 0 on the session's vLLM, attached; one restart with another config)."""

from __future__ import annotations

import subprocess

import pytest

from collector.db import make_engine
from tuner.metrics import SLO
from tuner.study import run_study
from tuner.vllm.argcheck import check_space
from tuner.vllm.backend import VllmBackend
from tuner.vllm.config import VllmConfig
from tuner.vllm.space import VllmSpace, load_vllm_space, vllm_space_from_dict
from tuner.workloads import WorkloadOptions, scenario

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def python() -> str:
    from tests.vllm.peer import vllm_python

    return vllm_python()


def test_shipped_space_is_what_the_installed_vllm_accepts(python: str) -> None:
    base = VllmConfig(model="/m")
    check = check_space(load_vllm_space(base=base), base, python=python)
    assert check.ok, check.problems
    assert check.probes > 20 and check.options["max_num_seqs"]["option"] == "--max-num-seqs"
    assert check.options["scheduling_policy"]["choices"] == ["fcfs", "priority"]


def test_names_and_values_vllm_does_not_know_are_refused(python: str) -> None:
    base = VllmConfig(model="/m")
    space = VllmSpace(
        vllm_space_from_dict(
            {"params": {"max_num_partial_prefills": {"choices": [1, 2]}, "block_size": {"choices": [16, 32]}}},
            base=base,
        ).params,
        {},
    )
    check = check_space(space, base, python=python)
    problems = check.problems
    assert any(p.startswith("max_num_partial_prefills: vLLM") and "no such option" in p for p in problems), problems
    assert any(p.startswith("max_num_partial_prefills=1: vLLM refuses it") for p in problems), problems
    if check.cpu:
        assert any(p.startswith("block_size=16: vLLM refuses it") for p in problems), problems


def test_a_proposal_file_is_read_by_vllms_own_config_loader(python: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = VllmConfig(
        model="/m", max_num_seqs=32, block_size=64, enable_chunked_prefill=False, max_num_batched_tokens=512
    )
    path = tmp_path / "proposal.yaml"
    path.write_text(cfg.to_config_yaml())
    code = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "p = FlexibleArgumentParser(); EngineArgs.add_cli_args(p)\n"
        "a = p.parse_args(['--config', sys.argv[1]])\n"
        "print(json.dumps({k: getattr(a, k) for k in sys.argv[2:]}))\n"
    )
    names = ["model", "max_num_seqs", "block_size", "enable_chunked_prefill", "enable_prefix_caching"]
    out = subprocess.run([python, "-c", code, str(path), *names], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "model": "/m",
        "max_num_seqs": 32,
        "block_size": 64,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": True,
    }


@pytest.mark.timeout(600)  # one vLLM start: 40-100 s on 2 busy cores (plus the session vLLM's, if first)
def test_a_tiny_study_on_real_vllm(vllm_peer, python: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Trial 0 runs on the session's vLLM (its config is the base config); trial 1 restarts vLLM with 64-token
    blocks and 16 sequences; both are measured from the spans the collector stored under each trial's run id."""
    from tests.vllm.peer import ADMIN_TOKEN, KV_CACHE_BYTES, MODEL, TOKEN

    base = VllmConfig(model=str(vllm_peer.checkpoint), served_model_name=MODEL, kv_cache_memory_bytes=KV_CACHE_BYTES)
    space = vllm_space_from_dict(
        {"params": {"block_size": {"choices": [128, 64]}, "max_num_seqs": {"choices": [128, 16]}}}, base=base
    )
    opts = WorkloadOptions(requests=12, scale=16.0, output_range=(4, 16), max_total_tokens=512)
    db = make_engine(vllm_peer.db_url)
    backend = VllmBackend(
        workload=lambda seed: scenario("mixed", 8.0, opts, seed=seed),
        db=db,
        slo=SLO(ttft_s=5.0, tpot_s=1.0),
        python=python,
        collector_url=vllm_peer.collector_url,
        ingest_token=TOKEN,
        admin_token=ADMIN_TOKEN,
        instance="tuner-vllm-test",
        warmup=2,
        log_dir=tmp_path,
    )
    backend.attach(base, url=vllm_peer.url, run_id="vllm-session")
    try:
        result = run_study(
            backend,
            space,
            base,
            name="tiny",
            trials=2,
            slo=SLO(ttft_s=5.0, tpot_s=1.0),
            random_baseline=False,
            progress=False,
            sampler="random",
            seed=3,
        )
    finally:
        backend.close()
        db.dispose()
    assert result.measured == 2 and result.failed == 0, [(t.state, t.infeasible) for t in result.trials]
    t0, t1 = sorted(result.trials, key=lambda t: t.number)
    assert t0.baseline and t0.run_id == "vllm-session" and t0.metrics["finished"] == 12
    assert t1.params != t0.params
    assert t1.metrics["finished"] == 12 and t1.run_id == backend.launches[0].run_id
    assert t1.metrics["throughput_tps"] > 0 and t1.metrics["ttft_p99_s"] is not None
    # the restarted trial's /metrics was a scrape target while it ran; its cleanup deleted it (the admin token)
    import httpx

    listed = httpx.get(f"{vllm_peer.collector_url}/v1/targets", headers={"Authorization": f"Bearer {TOKEN}"})
    assert backend.launches[0].target == "created", backend.launches[0]
    assert backend.stale_targets == [] and not any(t["instance"] == "tuner-vllm-test" for t in listed.json())
    costs = backend.restart_costs()
    assert costs["launches"] == 1 and costs["ready_s"]["mean"] > 0 and costs["stop_s"]["mean"] >= 0
