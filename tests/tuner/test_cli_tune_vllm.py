"""`kvpilot tune vllm screen|study` without vLLM: the screen on a simulator calibrated from steps stored through the
collector's ingest, and the bad-input paths (each a one-line error and a non-zero exit, nothing started)."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from collector.db import make_engine
from engine.events import RequestEvent, StepEvent
from integrations.vllm.config import VllmConfig
from kvpilot.cli import app
from tuner.metrics import store_events
from tuner.storage import open_storage

from .test_vllm_sim import _synthetic_steps

runner = CliRunner()
INSTANCE = "vllm-a"
# the model whose KV bytes per token size the simulated pool: 2 x 4 layers x 2 KV heads x 32 dims x 4 bytes
HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "max_position_embeddings": 2048,
}


def _steps(n: int, *, start: float) -> list[StepEvent]:
    """A vLLM's iteration lines as step rows of a known cost (tests/tuner/test_vllm_sim.py's), moved to `start`."""
    events = _synthetic_steps(n)
    return [e.model_copy(update={"ts": e.ts - events[0].ts + start}) for e in events]


def _requests(n: int, *, start: float) -> list[RequestEvent]:
    rng = random.Random(1)
    out = []
    for i in range(n):
        e2e = rng.uniform(0.2, 2.0)
        out.append(
            RequestEvent(
                instance=INSTANCE,
                run_id="prod",
                ts=start + 0.25 * i + e2e,
                request_id=f"r{i}",
                status="finished",
                prompt_tokens=rng.randint(20, 300),
                output_tokens=rng.randint(8, 64),
                queue_s=0.0,
                prefill_s=0.05,
                decode_s=e2e - 0.05,
                e2e_s=e2e,
            )
        )
    return out


@pytest.fixture
def setup(sqlite_url: str, tmp_path: Path) -> dict[str, str]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(HF_CONFIG))
    config = tmp_path / "running.yaml"
    running = VllmConfig(model=str(ckpt), kv_cache_memory_bytes=16 * 2**20).to_config_yaml()
    config.write_text(running + "host: 0.0.0.0\nport: 8000\n")  # where it listens: not the tuner's business
    return {"db": sqlite_url, "config": str(config), "ckpt": str(ckpt), "tmp": str(tmp_path)}


def _store(db_url: str, *, steps: int, requests: int = 0) -> None:
    db = make_engine(db_url)
    now = time.time()
    events: list = [*_steps(steps, start=now - 600), *_requests(requests, start=now - 300)]
    store_events(db, events, key_prefix="test")
    db.dispose()


def _screen(setup: dict[str, str], *extra: str):
    args = ["tune", "vllm", "screen", "--config", setup["config"], "--instance", INSTANCE, "--db-url", setup["db"]]
    return runner.invoke(app, [*args, "--no-arg-check", *extra])


def test_screen_ranks_configs_in_a_simulator_calibrated_from_stored_steps(setup: dict[str, str]) -> None:
    _store(setup["db"], steps=400, requests=40)
    out = Path(setup["tmp"]) / "screen.json"
    # the stored traffic 25x faster: enough load that the configs differ
    args = ["--workload", "stored:vllm-a", "--time-scale", "25", "--screen", "8", "--top", "2", "--json", str(out)]
    res = _screen(setup, *args)
    assert res.exit_code == 0, res.output
    assert "tune vllm screen: 8 configs simulated" in res.stdout and "400 stored steps of vllm-a" in res.stdout
    assert "running config:" in res.stdout and "\n  1. " in res.stdout
    data = json.loads(out.read_text())
    assert data["workload"]["kind"] == "stored" and data["workload"]["requests"] == 40
    assert data["profile"]["steps"] == 400 and data["profile"]["runs"] == ["cal"]
    assert data["running"]["sim_goodput_tps"] > 0 and 1 <= len(data["top"]) <= 2
    predicted = [row["sim_goodput_tps"] for row in data["top"]]
    assert predicted == sorted(predicted, reverse=True)
    # The screen's simulated study is kept beside the database, tagged as a vLLM screen (the Tuning page lists it).
    storage = open_storage(setup["db"])
    (kept,) = [x for x in optuna.get_all_study_summaries(storage) if x.study_name == data["study"]]
    assert (kept.user_attrs["engine"], kept.user_attrs["kind"], kept.n_trials) == ("vllm", "screen", 8)
    assert f"study {data['study']}: on the dashboard's Tuning page" in res.stdout
    for row in data["top"]:
        assert row["changed"] and row["sim_goodput_tps"] > 0
        proposal = VllmConfig.from_config_text(row["config_yaml"])  # what `vllm serve --config` would get
        assert "port" not in row["config_yaml"] and not proposal.extra_args
        assert {k: getattr(proposal, k) for k in row["changed"]} == row["changed"]


def test_screen_simulates_a_scenarios_capacity_when_none_is_given(setup: dict[str, str]) -> None:
    _store(setup["db"], steps=300)
    out = Path(setup["tmp"]) / "screen.json"
    res = _screen(setup, "--workload", "mixed", "--requests", "30", "--screen", "4", "--top", "1", "--json", str(out))
    assert res.exit_code == 0, res.output
    workload = json.loads(out.read_text())["workload"]
    assert workload["kind"] == "mixed" and workload["capacity"] == "simulated" and workload["capacity_rps"] > 0
    assert f"capacity {workload['capacity_rps']} req/s (simulated)" in res.stdout


def test_too_few_stored_steps_says_how_many_are_needed(setup: dict[str, str]) -> None:
    _store(setup["db"], steps=50)
    res = _screen(setup, "--workload", "mixed", "--capacity", "10")
    assert res.exit_code == 2
    assert "instance(s) vllm-a: 50 stored vLLM steps with work (need >= 200)" in res.output
    assert "Traceback" not in res.output


def _study(setup: dict[str, str], *extra: str):
    args = ["tune", "vllm", "study", "--config", setup["config"], "--db-url", setup["db"]]
    return runner.invoke(app, [*args, "--vllm-python", sys.executable, "--out-dir", setup["tmp"], *extra])


@pytest.mark.parametrize("command", ["study", "screen"])
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--workload", "spiky"], "workload: unknown workload 'spiky'; one of mixed, burst, sustained"),
        (["--workload", "stored:"], "workload: stored: needs an instance, e.g. stored:vllm-a"),
        (["--model", "/nonexistent/ckpt"], "model: /nonexistent/ckpt is not a directory"),
        (["--ttft-slo", "0"], "slo: ttft_s: must be positive"),
        (["--screen", "5001"], "sim_trials: at most 5000, got 5001"),
        (["--seeds-per-trial", "11"], "tuning_seeds: at most 10, got 11"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(setup: dict[str, str], command: str, extra: list[str], message: str) -> None:
    res = (_study if command == "study" else _screen)(setup, *extra)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def _nightly(setup: dict[str, str], *extra: str):
    args = ["tune", "vllm", "nightly", "--config", setup["config"], "--instance", INSTANCE, "--db-url", setup["db"]]
    return runner.invoke(app, [*args, "--vllm-python", sys.executable, "--out-dir", setup["tmp"], *extra])


@pytest.mark.parametrize("command", ["study", "nightly"])
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--port-range", "lots"], "port_range: expected LOW-HIGH (e.g. 20000-20100), got 'lots'"),
        (["--port-range", "20100-20000"], "port_range: expected LOW-HIGH with 1024 <= LOW <= HIGH <= 65535"),
        (["--port-range", "80-90"], "got '80-90'"),
        (["--port-range", "20000"], "port_range: expected LOW-HIGH (e.g. 20000-20100), got '20000'"),
        (
            ["--heldout-seeds", "1"],
            "heldout_seeds: --heldout-seeds must be >= 2, got 1: the gain's lower bound needs at least two paired "
            "runs, so with one no proposal could ever be written",
        ),
        (["--pair-replays", "1"], "pair_replays: must be within 2..12, got 1"),
        (["--capacity-replays", "99"], "capacity_replays: must be within 2..12, got 99"),
    ],
)
def test_ports_and_held_out_seeds_are_checked_before_anything_starts(
    setup: dict[str, str], command: str, extra: list[str], message: str
) -> None:
    res = (_study if command == "study" else _nightly)(setup, *extra)
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()) and "Traceback" not in res.output


def _row_counts(db_url: str) -> dict[str, int]:
    from sqlalchemy import func, select

    from collector.schema import Base

    db = make_engine(db_url)
    with db.connect() as conn:
        counts = {
            t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
            for t in Base.metadata.tables.values()
        }
    db.dispose()
    return counts


def test_screen_writes_nothing_into_the_collector_s_database(setup: dict[str, str]) -> None:
    _store(setup["db"], steps=300, requests=40)
    before = _row_counts(setup["db"])
    assert before["requests"] == 40 and before["steps"] == 300
    res = _screen(setup, "--time-scale", "25", "--screen", "6", "--top", "1")  # the stored workload by default
    assert res.exit_code == 0, res.output
    assert "workload: stored" in res.stdout
    assert _row_counts(setup["db"]) == before  # 6 simulated trials and their pruning: not a row


def test_a_space_naming_an_argument_vllm_does_not_have_is_refused(setup: dict[str, str]) -> None:
    space = Path(setup["tmp"]) / "space.yml"
    space.write_text("params:\n  max_num_frobs: {choices: [1, 2]}\n")
    for res in (_study(setup, "--space", str(space)), _screen(setup, "--space", str(space))):
        assert res.exit_code == 2, res.output
        assert "params.max_num_frobs: not a tuned vLLM argument; one of max_num_seqs" in res.output


def test_study_without_a_reachable_collector_starts_nothing(setup: dict[str, str]) -> None:
    res = _study(setup, "--collector", "http://127.0.0.1:9", "--capacity", "5")
    assert res.exit_code == 1, res.output
    assert "collector: cannot reach http://127.0.0.1:9" in res.output and "kvpilot collector serve" in res.output
    assert "Traceback" not in res.output and not list(Path(setup["tmp"]).glob("proposal-*.yaml"))


def test_a_missing_config_file_and_no_vllm_are_bad_input(setup: dict[str, str], tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["tune", "vllm", "study", "--config", str(tmp_path / "nope.yaml"), "--db-url", setup["db"]]
    )
    assert res.exit_code == 2 and "nope.yaml: cannot read a vLLM config" in res.output
    res = _study(setup, "--vllm-python", str(tmp_path / "no-python"))
    assert res.exit_code == 2 and "is not an executable Python interpreter" in res.output
