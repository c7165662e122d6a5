"""The `kvpilot engine` commands: config errors are CLI errors naming the field; serve really serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import yaml
from typer.testing import CliRunner

from kvpilot.cli import app
from plumbing.process import free_port, wait_healthy
from tests.engine.conftest import TINY_MODEL

runner = CliRunner()


def test_config_command_prints_defaults_filled_in(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"scheduler": {"max_num_seqs": 7}}))
    result = runner.invoke(app, ["engine", "config", "--config", str(path)])
    assert result.exit_code == 0
    data = yaml.safe_load(result.stdout)
    assert data["scheduler"]["max_num_seqs"] == 7 and data["cache"]["block_size"] == 32


def test_bad_config_values_name_the_field(tmp_path: Path) -> None:
    cases = {
        "cache:\n  block_size: 24\n": "cache.block_size",
        "scheduler:\n  max_num_seqs: -1\n": "scheduler.max_num_seqs",
        "model:\n  dim: 100\n  n_heads: 8\n": "n_heads",
        "recycler:\n  mode: sometimes\n": "recycler.mode",
        "nonsense: 1\n": "nonsense",
        "scheduler: [1, 2\n": "not valid YAML",
    }
    for text, needle in cases.items():
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        result = runner.invoke(app, ["engine", "config", "--config", str(path)])
        assert result.exit_code == 2, text
        assert needle in result.output, (text, result.output)
    missing = runner.invoke(app, ["engine", "config", "--config", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "not found" in missing.output


def test_engine_serve_applies_a_proposal_file(tmp_path: Path) -> None:
    port = free_port()
    cfg = {
        "device": "cpu",
        "model": TINY_MODEL,
        "warmup": {"requests": 1, "prompt_tokens": 4, "max_tokens": 2},
        "scheduler": {"max_num_seqs": 5},
        "cache": {"block_policy": "dynamic"},
        "telemetry": {"sink": "none"},
    }
    path = tmp_path / "proposal.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpilot.cli",
            "engine",
            "serve",
            "--config",
            str(path),
            "--port",
            str(port),
            "--admin-token",
            "t0k",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s=60, what="engine")
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
        conf = httpx.get(f"http://127.0.0.1:{port}/admin/config", headers={"Authorization": "Bearer t0k"}).json()
        assert conf["tunable"]["scheduler"]["max_num_seqs"] == 5
        assert conf["tunable"]["cache"]["block_policy"] == "dynamic"
    finally:
        proc.terminate()
        proc.wait(15)
