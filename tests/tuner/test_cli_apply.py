"""`kvpilot tune` / `kvpilot sim` commands and applying a proposal to a running engine's /admin/config."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from collector.db import make_engine
from engine.config import EngineConfig
from engine.factory import build_app
from kvpilot.cli import app
from tuner.proposals import ApplyError, apply_proposal, create_proposal, get_proposal

from .conftest import TINY_MODEL, tiny_profile

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_tune_study_cli_writes_a_json_summary(sqlite_url: str, tmp_path) -> None:
    prof = tmp_path / "tiny.json"
    tiny_profile().save(prof)
    out = tmp_path / "s.json"
    res = _run(
        "tune",
        "study",
        "--trials",
        "3",
        "--profile",
        str(prof),
        "--requests",
        "20",
        "--scale",
        "16",
        "--output-range",
        "4,16",
        "--db-url",
        sqlite_url,
        "--study-name",
        "cli",
        "--json",
        str(out),
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())
    assert summary["trials"] == 3 and summary["random_trials"] == 3 and summary["backend"] == "sim"
    assert summary["baseline_metrics"]["requests"] == 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "gpu"], "backend: one of sim, engine, live"),
        (["--sampler", "cmaes"], "sampler: one of tpe, tpe-startup10, tpe-startup3, tpe-independent, random"),
        (["--workload", "spiky"], "workload: unknown workload 'spiky'"),
        (["--output-range", "9"], "output_range: expected LOW,HIGH"),
        (["--ttft-slo", "0"], "slo: ttft_s: must be positive"),
        (["--profile", "nope"], "profile 'nope' not found"),
        (["--backend", "live"], "engine_url: the live backend needs --engine-url"),
    ],
)
def test_tune_study_bad_input_exits_2_naming_the_field(sqlite_url: str, args: list[str], message: str) -> None:
    res = runner.invoke(app, ["tune", "study", "--trials", "2", "--db-url", sqlite_url, *args])
    assert res.exit_code == 2
    assert message in res.output


def test_unmigrated_database_is_refused(tmp_path) -> None:
    res = runner.invoke(app, ["tune", "proposals", "list", "--db-url", f"sqlite:///{tmp_path / 'empty.db'}"])
    assert res.exit_code == 2 and "kvpilot db upgrade" in res.output


def test_bad_space_file_names_the_field(sqlite_url: str, tmp_path) -> None:
    space = tmp_path / "space.yml"
    space.write_text("params:\n  scheduler.max_num_seqs: {choices: [0]}\n")
    res = runner.invoke(app, ["tune", "study", "--db-url", sqlite_url, "--space", str(space)])
    assert res.exit_code == 2 and "params.scheduler.max_num_seqs value 0 is invalid" in res.output


def test_sim_run_what_if_at_gpu_scale(tmp_path) -> None:
    out = tmp_path / "w.json"
    res = _run(
        "sim",
        "run",
        "--profile",
        "h200-llama3-8b",
        "--workload",
        "mixed",
        "--requests",
        "60",
        "--scale",
        "1",
        "--output-range",
        "32,128",
        "--set",
        "scheduler.max_num_seqs=128",
        "--json",
        str(out),
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["metrics"]["finished"] == 60 and data["patch"] == {"scheduler": {"max_num_seqs": 128}}
    assert data["workload"]["capacity_rps"] > 10  # an H200 serves an 8B model far faster than a CPU
    bad = runner.invoke(app, ["sim", "run", "--set", "model.dim=8"])
    assert bad.exit_code == 2 and "model: the simulator runs the profile's model" in bad.output
    bad = runner.invoke(app, ["sim", "run", "--set", "scheduler.max_num_seqs"])
    assert bad.exit_code == 2 and "expected section.field=value" in bad.output


def test_proposals_review_cli(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    p = create_proposal(
        db,
        config_yaml=EngineConfig().to_yaml(),
        report_md="# r",
        study_name="s",
        instance=None,
        baseline_metrics={},
        best_metrics={"confirmation": {"gain": 0.12}},
    )
    res = _run("tune", "proposals", "list", "--db-url", sqlite_url)
    assert f"{p.id}" in res.output and "pending" in res.output and "+12.0%" in res.output
    assert _run("tune", "proposals", "accept", str(p.id), "--db-url", sqlite_url).exit_code == 0
    res = runner.invoke(app, ["tune", "proposals", "accept", str(p.id), "--db-url", sqlite_url])
    assert res.exit_code == 2 and "accepted; it cannot become accepted" in res.output
    assert get_proposal(db, p.id).status == "accepted"
    db.dispose()


def _engine_app(token: str | None = "secret"):
    cfg = EngineConfig.from_dict(
        {
            "device": "cpu",
            "model": dict(TINY_MODEL),
            "warmup": {"requests": 0},
            "server": {"admin_token": token},
            "telemetry": {"sink": "none"},
        }
    )
    return build_app(cfg, warmup=False), cfg


def test_apply_puts_the_tunables_to_the_engine(sqlite_url: str) -> None:
    app_, cfg = _engine_app()
    proposed = cfg.with_tunable({"scheduler": {"max_num_seqs": 7}, "cache": {"block_size": 64}})
    db = make_engine(sqlite_url)
    p = create_proposal(
        db,
        config_yaml=proposed.to_yaml(),
        report_md="",
        study_name="s",
        instance="engine-0",
        baseline_metrics={},
        best_metrics={},
    )
    with TestClient(app_) as client:
        with pytest.raises(ApplyError, match="HTTP 403"):
            apply_proposal(db, p.id, engine_url="http://test", admin_token="wrong", client=client)
        assert get_proposal(db, p.id).status == "pending"  # nothing marked on failure
        done = apply_proposal(db, p.id, engine_url="http://test", admin_token="secret", client=client)
        live = client.get("/admin/config", headers={"Authorization": "Bearer secret"}).json()["tunable"]
    assert done.status == "applied"
    assert live["scheduler"]["max_num_seqs"] == 7 and live["cache"]["block_size"] == 64
    assert done.best_metrics["apply"]["previous_tunable"]["scheduler"]["max_num_seqs"] == 32
    with pytest.raises(Exception, match="applied; only pending or accepted"):
        apply_proposal(db, p.id, engine_url="http://test", admin_token="secret")
    db.dispose()


def test_apply_to_an_unreachable_engine_exits_1(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    p = create_proposal(
        db,
        config_yaml=EngineConfig().to_yaml(),
        report_md="",
        study_name="s",
        instance=None,
        baseline_metrics={},
        best_metrics={},
    )
    res = runner.invoke(app, ["tune", "apply", str(p.id), "--db-url", sqlite_url, "--engine-url", "http://127.0.0.1:9"])
    assert res.exit_code == 1 and "failed" in res.output
    assert get_proposal(db, p.id).status == "pending"
    db.dispose()
