"""Tuning a real vLLM: the search space against vLLM's own parser (and the CLI refusing what vLLM refuses), the
proposal file read by vLLM, and a tiny `kvpilot tune vllm study` end to end (the running config on the session's
vLLM, attached; one restart for the confirmed config)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from integrations.vllm.argcheck import check_space
from integrations.vllm.config import VllmConfig
from kvpilot.cli import app
from tuner.vllm.space import VllmSpace, load_vllm_space, vllm_space_from_dict

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


def test_a_proposal_file_is_read_by_vllms_own_config_loader(python: str, tmp_path) -> None:
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
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "model": "/m",
        "max_num_seqs": 32,
        "block_size": 64,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": True,
    }


def test_the_cli_refuses_a_space_the_installed_vllm_does_not_accept(python: str, sqlite_url: str, tmp_path) -> None:
    """The tuner knows `max_num_partial_prefills`, vLLM 0.32 does not: refused before anything is read or started."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4}')
    config, space = tmp_path / "running.yaml", tmp_path / "space.yml"
    config.write_text(VllmConfig(model=str(ckpt)).to_config_yaml())
    space.write_text("params:\n  max_num_partial_prefills: {choices: [1, 2]}\n  max_num_seqs: {choices: [16, 32]}\n")
    args = ["--config", str(config), "--space", str(space), "--vllm-python", python, "--db-url", sqlite_url]
    res = CliRunner().invoke(app, ["tune", "vllm", "screen", "--instance", "vllm-a", *args])
    assert res.exit_code == 2, res.output
    assert f"{space}: vLLM 0.32" in res.output and "max_num_partial_prefills: vLLM" in res.output
    assert "parser has no such option" in res.output and "Traceback" not in res.output


@pytest.mark.timeout(600)  # one vLLM start: 40-100 s on 2 busy cores (plus the session vLLM's, if first)
def test_a_tiny_study_on_real_vllm_through_the_cli(vllm_peer, python: str, tmp_path) -> None:
    """`kvpilot tune vllm study` with the session's vLLM as the running config (attached: no start), calibrated from
    the steps the session stored; the space pins 64-token blocks, so the best simulated config differs from the
    running one and is confirmed live (the one vLLM start) with its capacity; unless the simulator put it under the
    running one or its search lost by more than `CONFIRM_LOSS`, both alternate in ABBA pairs on two held-out seeds.
    Either way the exit code says whether a proposal was written."""
    from tests.vllm.peer import ADMIN_TOKEN, INSTANCE, KV_CACHE_BYTES, MODEL, TOKEN

    base = VllmConfig(model=str(vllm_peer.checkpoint), served_model_name=MODEL, kv_cache_memory_bytes=KV_CACHE_BYTES)
    config, space, out = tmp_path / "running.yaml", tmp_path / "space.yml", tmp_path / "study.json"
    config.write_text(base.to_config_yaml())
    space.write_text("params:\n  max_num_seqs: {choices: [128, 16]}\nfixed:\n  block_size: 64\n")
    workload = ["--workload", "mixed", "--capacity", "8", "--requests", "12", "--scale", "16", "--output-range", "4,16"]
    budget = ["--screen", "4", "--confirm", "1", "--heldout-seeds", "2", "--instance", INSTANCE, "--min-steps", "50"]
    budget += ["--keep-servers"]  # one vLLM start here; fresh servers per round: tests/vllm/test_capacity_compare.py
    budget += ["--capacity-replays", "3", "--pair-replays", "2"]  # short searches: the wiring is what is tested here
    res = CliRunner().invoke(
        app,
        [
            "tune", "vllm", "study", "--config", str(config), "--space", str(space), *workload, *budget,
            "--ttft-slo", "5", "--p99-ttft-slo", "1", "--tpot-slo", "1", "--hours", "1", "--no-arg-check",
            "--running-url", vllm_peer.url, "--running-run-id", "vllm-session",
            "--collector", vllm_peer.collector_url, "--ingest-token", TOKEN, "--admin-token", ADMIN_TOKEN,
            "--db-url", vllm_peer.db_url,
            "--vllm-python", python, "--out-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
            "--json", str(out),
        ],
    )  # fmt: skip
    assert res.exit_code in (0, 3), res.output
    s = json.loads(out.read_text())
    assert len(s["screened"]) == 2, (res.output, s["screened"])
    running, confirmed = s["screened"]
    assert s["baseline"]["metrics"]["finished"] == 12 and running["changed"] == {} and running["feasible"]
    assert confirmed["changed"]["block_size"] == 64 and confirmed["feasible"] and confirmed["live_goodput"] > 0
    assert s["restart_cost"]["launches"] == 1 and s["restart_cost"]["ready_s"]["mean"] > 0
    assert s["capacity"]["capacity_rps"] > 0 and [c["changed"] for c in s["capacities"]] == [{}, {"block_size": 64}]
    # the running config's full search within --capacity-replays; the confirmation's near it within
    # --pair-replays, and a wide search of --capacity-replays only if those did not bracket it
    assert s["capacities"][0]["live"]["replays"] <= 3 and s["capacities"][1]["live"]["replays"] <= 2 + 3
    # the restarted trial's /metrics was a scrape target while it ran; its cleanup deleted it (the admin token)
    listed = httpx.get(f"{vllm_peer.collector_url}/v1/targets", headers={"Authorization": f"Bearer {TOKEN}"})
    assert s["scrape_targets"] == {"registered": ["created"], "left": []}, s["scrape_targets"]
    assert not any(t["instance"] == "tuner-vllm" for t in listed.json())
    assert "restart cost per trial:" in res.stdout and s["decision"] in res.stdout
    if s["changed"]:  # the confirmed config is the candidate: both alternated on the held-out seeds
        assert s["changed"]["block_size"] == 64
        assert [p["seed"] for p in s["heldout"]["pairs"]] == [1000, 1001] and "ABBA pair(s)" in res.stdout
        assert s["heldout"]["fresh_servers"] is False
    else:  # no candidate, and the decision says why (`tuner.vllm.tune.choose`)
        assert s["heldout"] is None, s["decision"]
        assert "the simulator found no config" in s["decision"] or "not worth a held-out" in s["decision"]
    assert s["client"]["late_replays"] >= 0 and s["client"]["late_p99_s"] is not None
    if res.exit_code == 0:  # the gain held: the proposal is the confirmed config, as vLLM's --config file
        assert VllmConfig.from_config_yaml(s["proposal"]["config"]).block_size == 64
    else:
        assert s["proposal"] is None and s["decision"].startswith("no proposal") and Path(s["report"]).is_file()
