"""`tune study` and `sim run` print a human summary; the JSON only with --json; vLLM proposals in the table."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from collector.db import make_engine
from integrations.vllm.config import VllmConfig
from kvpilot.cli import app
from tuner.proposals import ProposalError, apply_proposal, create_proposal

from .conftest import tiny_profile

runner = CliRunner()


def test_study_and_sim_run_print_a_summary_and_json_only_on_request(sqlite_url: str, tmp_path) -> None:
    prof = tmp_path / "tiny.json"
    tiny_profile().save(prof)
    common = ["--profile", str(prof), "--requests", "20", "--scale", "16", "--output-range", "4,16"]
    res = runner.invoke(
        app, ["tune", "study", "--trials", "3", "--db-url", sqlite_url, "--no-random-baseline", *common]
    )
    assert res.exit_code == 0, res.output
    out = res.stdout  # the progress bar goes to stderr
    assert out.startswith("study tune-") and "3 trials measured" in out
    assert "running config:" in out and "goodput tokens/s" in out and "{" not in out
    path = tmp_path / "sim.json"
    res = runner.invoke(app, ["sim", "run", *common, "--set", "scheduler.max_num_seqs=8", "--json", str(path)])
    assert res.exit_code == 0, res.output
    assert "sim run on tiny-test" in res.stdout and "20/20 requests finished" in res.stdout
    assert f"JSON written to {path}" in res.stdout and "{" not in res.stdout
    assert json.loads(path.read_text())["metrics"]["finished"] == 20


def test_a_vllm_proposal_is_a_vllm_config_and_is_not_applied_over_http(sqlite_url: str) -> None:
    db = make_engine(sqlite_url)
    cfg = VllmConfig(model="/m", max_num_seqs=32)
    p = create_proposal(
        db,
        config_yaml=cfg.to_config_yaml(),
        report_md="# r",
        study_name="s",
        instance="vllm-a",
        baseline_metrics={},
        best_metrics={"confirmation": {"gain": 0.1}},
        engine="vllm",
    )
    assert p.engine == "vllm" and VllmConfig.from_config_text(p.config_yaml).max_num_seqs == 32
    with pytest.raises(ProposalError, match="not a kvpilot EngineConfig"):
        p.config()
    with pytest.raises(ProposalError, match="restart it with `--config proposal-"):
        apply_proposal(db, p.id, engine_url="http://127.0.0.1:9", admin_token=None)
    with pytest.raises(ValueError, match="max_num_seqs"):
        create_proposal(
            db,
            config_yaml="max-num-seqs: many\n",
            report_md="",
            study_name=None,
            instance=None,
            baseline_metrics={},
            best_metrics={},
            engine="vllm",
        )
    res = runner.invoke(app, ["tune", "proposals", "list", "--db-url", sqlite_url])
    assert res.exit_code == 0 and f"{p.id}" in res.output and "+10.0%" in res.output
    assert res.output.split()[:3] == [str(p.id), "pending", "vllm"]  # whose config it is
    res = runner.invoke(app, ["tune", "apply", str(p.id), "--db-url", sqlite_url])
    assert res.exit_code == 2 and "vLLM has no hot reload; restart it with `--config proposal-" in res.output
    db.dispose()


def test_apply_checks_the_instance_and_keeps_the_diff(sqlite_url: str) -> None:
    from fastapi.testclient import TestClient

    from tuner.proposals import get_proposal

    from .test_cli_apply import _engine_app

    app_, cfg = _engine_app()  # telemetry.instance: engine-0
    proposed = cfg.with_tunable({"scheduler": {"max_num_seqs": 7}})
    db = make_engine(sqlite_url)

    def propose(instance: str) -> int:
        return create_proposal(
            db,
            config_yaml=proposed.to_yaml(),
            report_md="",
            study_name="s",
            instance=instance,
            baseline_metrics={},
            best_metrics={},
        ).id

    other, ours = propose("engine-9"), propose("engine-0")
    with TestClient(app_) as client:
        with pytest.raises(
            ProposalError, match="made for instance 'engine-9', but the engine at http://test is 'engine-0'"
        ):
            apply_proposal(db, other, engine_url="http://test", admin_token="secret", client=client)
        assert get_proposal(db, other).status == "pending"
        done = apply_proposal(db, ours, engine_url="http://test", admin_token="secret", client=client)
    assert done.best_metrics["apply"]["diff"] == [["scheduler.max_num_seqs", 32, 7]]
    assert done.best_metrics["apply"]["instance"] == "engine-0"
    db.dispose()
