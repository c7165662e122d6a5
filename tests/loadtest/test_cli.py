from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpilot.cli import app
from kvpilot.loadtest.report import render_table

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--scenario", "spiky", "--quick"], "--scenario"),
        (["--quick", "--duration", "0s"], "--duration"),
        (["--quick", "--duration", "soon"], "--duration"),
        (["--scenario", "trace", "--quick"], "--trace"),
        (["--scenario", "trace", "--trace", "/nonexistent.csv", "--quick"], "--trace"),
        (["--target", "ftp://127.0.0.1:1"], "--target"),
        (["--duration", "5s"], "--target"),
        (["--fault", "meteor", "--quick"], "--fault"),
        (["--fault", "slow-client", "--target", "http://127.0.0.1:1"], "--target"),
        (["--quick", "--api", "grpc"], "--api"),
        (["--quick", "--p99-metric", "p42"], "--p99-metric"),
        (["--scenario", "sustained", "--quick", "--capacity-share", "1.5"], "--capacity-share"),
        (["--quick", "--collector", "nope"], "--collector"),
    ],
)
def test_bad_input_names_the_option(args: list[str], option: str) -> None:
    result = runner.invoke(app, ["loadtest", *args])
    assert result.exit_code == 2, result.output
    assert option in result.output


def test_bad_engine_config_names_the_option(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: {dim: 63, n_heads: 4}\n")
    result = runner.invoke(app, ["loadtest", "--quick", "--engine-config", str(cfg), "--no-progress"])
    assert result.exit_code == 2
    assert "--engine-config" in result.output and "model" in result.output


def test_quick_burst_against_its_own_engine(tmp_path: Path) -> None:
    out = tmp_path / "lt.json"
    result = runner.invoke(
        app, ["loadtest", "--scenario", "burst", "--quick", "--duration", "8s", "--json", str(out), "--no-progress"]
    )
    assert result.exit_code in (0, 1), result.output
    report = json.loads(out.read_text())
    assert result.exit_code == (0 if report["passed"] else 1)
    for key in (
        "passed",
        "oom_events",
        "p99_s",
        "p99_drift",
        "util_fluctuation",
        "requests_sent",
        "requests_answered",
        "requests_refused",
    ):
        assert key in report
    assert (
        report["requests_sent"]
        == report["requests_answered"]
        + report["requests_refused"]
        + report["requests_failed"]
        + report["requests_timed_out"]
    )
    assert report["requests_failed"] == report["requests_timed_out"] == 0
    assert report["oom_events"] == 0  # the default pool is far larger than this load
    assert report["burst"]["sent_in_burst"] > 2 * 6.0 * 2.0  # the 2 s burst carries 6x the base rate
    assert report["p99_s"] > 0 and report["util_fluctuation"] is not None
    assert report["passed"] == all(c["passed"] for c in report["criteria"].values())
    assert "RESULT" in result.output
    assert "burst @ 6.0 req/s (--rate)" in result.output  # --quick's rate, and where it came from
    tokens = report["tokens"]  # /generate: text is exact on the byte-level tokenizer, counts are the engine's
    assert tokens["prompt_form"].startswith("text") and tokens["output_counted_by"] == "server"
    assert tokens["output_served"] == tokens["output_planned"]  # ignore_eos
    assert report["client_lateness"]["count"] == report["requests_sent"]


def test_openai_api_on_a_server_without_tokenize_or_usage_says_what_it_counted() -> None:
    """kvpilot's own engine on the OpenAI API: no /tokenize (text prompts, exact on its byte-level tokenizer) and
    no usage in its stream (the client counts chunks); the report names both instead of passing them off as the
    server's counts."""
    from kvpilot.loadtest.session import LoadTestSpec, run_loadtest

    spec = LoadTestSpec(
        scenario="mixed", duration_s=4.0, rate=2.0, api="openai", length_scale=8.0, output_scale=8.0, windows=2,
        progress=False,
    )  # fmt: skip
    report = run_loadtest(spec)
    assert report["requests_answered"] == report["requests_sent"] > 0, report["errors_sample"]
    tokens = report["tokens"]
    assert tokens["prompt_form"].startswith("text (no token ids from POST /tokenize: HTTP 404"), tokens
    assert tokens["output_counted_by"] == "client chunks" and tokens["prompt_served"] is None
    assert 0 < tokens["output_served"] <= tokens["output_planned"]
    assert "output counted by client chunks" in render_table(report)
