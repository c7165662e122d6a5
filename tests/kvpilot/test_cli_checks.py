"""The CLI's edges: --version, --db-url everywhere, help texts, one-line errors (never a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from engine.config import ConfigError, EngineConfig
from engine.factory import build_app
from engine.preflight import check_engine_config
from kvpilot.cli import app
from tests.engine.conftest import TINY_MODEL, tiny_config

runner = CliRunner()


def _one_line_error(result, needle: str) -> None:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output and needle in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_version() -> None:
    from kvpilot import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"kvpilot {__version__}"


def test_alerts_commands_take_db_url_and_still_accept_db(sqlite_url: str) -> None:
    add = runner.invoke(app, ["alerts", "silence", "add", "alertname=MemoryPressure", "--db-url", sqlite_url])
    assert add.exit_code == 0, add.output
    silence_id = add.output.strip()
    assert silence_id in runner.invoke(app, ["alerts", "silence", "list", "--db", sqlite_url]).output
    assert runner.invoke(app, ["alerts", "silence", "expire", silence_id, "--db-url", sqlite_url]).exit_code == 0
    for cmd in (["run"], ["silence", "add"]):
        text = runner.invoke(app, ["alerts", *cmd, "--help"], terminal_width=200).output
        assert "--db-url" in text and "--db " not in text  # the old name works but is not advertised


@pytest.mark.parametrize(
    ("group", "commands"),
    [(["alerts", "silence"], ("add", "list", "expire")), (["tune", "proposals"], ("list", "show", "accept", "reject"))],
)
def test_subcommands_have_help(group: list[str], commands: tuple[str, ...]) -> None:
    listing = runner.invoke(app, [*group, "--help"]).output
    for command in commands:
        line = next(line for line in listing.splitlines() if f" {command} " in line)
        assert len(line.strip("│ ").split()) > 1, f"{command} has no help: {line!r}"


def test_engine_config_and_serve_refuse_a_pool_too_small_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "tiny-pool.yaml"
    path.write_text(yaml.safe_dump({"cache": {"hot_bytes": 100}}))
    for command in (["engine", "config"], ["engine", "serve", "--port", "0"]):
        _one_line_error(runner.invoke(app, [*command, "--config", str(path)]), "cache.hot_bytes")


def test_check_engine_config_sizes_against_the_model() -> None:
    check_engine_config(EngineConfig())  # the defaults serve
    with pytest.raises(ConfigError) as err:
        check_engine_config(EngineConfig.from_dict({"cache": {"hot_bytes": 100}}))
    assert err.value.field == "cache.hot_bytes"
    small = {"model": TINY_MODEL, "cache": {"hot_bytes": 64 * 1024}, "warmup": {"requests": 1, "prompt_tokens": 900}}
    with pytest.raises(ConfigError, match="warm-up request needs") as err:
        check_engine_config(EngineConfig.from_dict(small))
    assert err.value.field == "cache.hot_bytes"
    check_engine_config(EngineConfig.from_dict({**small, "warmup": {"requests": 0}}))  # no warm-up, nothing to fit
    with pytest.raises(ConfigError) as err:
        check_engine_config(EngineConfig.from_dict({"model": {"checkpoint": "/nonexistent/ckpt"}}))
    assert err.value.field == "model.checkpoint"


def test_misspelt_keys_are_unknown_not_unreloadable() -> None:
    cfg = EngineConfig()
    with pytest.raises(ConfigError, match=r"cache\.hot_byte: unknown key; did you mean hot_bytes\?"):
        cfg.with_tunable({"cache": {"hot_byte": 1}})
    with pytest.raises(ConfigError, match="cahce: unknown key; did you mean cache"):
        cfg.with_tunable({"cahce": {}})
    with pytest.raises(ConfigError, match="not hot-reloadable"):
        cfg.with_tunable({"cache": {"hot_bytes": 2**20}})
    assert cfg.with_overrides({"cache": {"hot_bytes": 2**20}}).cache.hot_bytes == 2**20
    with pytest.raises(ConfigError, match=r"scheduler\.max_num_seq: unknown key"):
        cfg.with_overrides({"scheduler": {"max_num_seq": 4}})
    with pytest.raises(ConfigError, match="model: fixed here"):
        cfg.with_overrides({"model": {"dim": 8}}, frozen={"model": "fixed here"})


def test_admin_config_names_an_unknown_key() -> None:
    cfg = tiny_config(server={"admin_token": "t"})
    with TestClient(build_app(cfg, warmup=False)) as client:
        headers = {"Authorization": "Bearer t"}
        r = client.put("/admin/config", json={"scheduler": {"max_num_seq": 3}}, headers=headers)
        assert r.status_code == 422 and r.json()["detail"]["field"] == "scheduler.max_num_seq"
        assert "unknown key" in r.json()["detail"]["message"]
        r = client.put("/admin/config", json={"cache": {"hot_bytes": 1}}, headers=headers)
        assert r.status_code == 422 and "not hot-reloadable" in r.json()["detail"]["message"]


def test_the_engine_says_its_weights_are_random() -> None:
    with TestClient(build_app(tiny_config(), warmup=False)) as client:
        health = client.get("/health").json()
        assert health["weights"] == "random" and "model.checkpoint" in health["note"]
        body = client.post("/generate", json={"prompt": "hi", "max_tokens": 2}).json()
        assert body["weights"] == "random" and body["model"] == "kvpilot-llama"


def test_sim_run_set_takes_pool_sizes_and_names_unknown_keys(tmp_path) -> None:
    _one_line_error(runner.invoke(app, ["sim", "run", "--set", "cache.hot_byte=1"]), "cache.hot_byte: unknown key")
    _one_line_error(runner.invoke(app, ["sim", "run", "--set", "model.dim=8"]), "model: the simulator runs")
    ok = runner.invoke(
        app,
        [
            "sim",
            "run",
            "--requests",
            "8",
            "--scale",
            "16",
            "--output-range",
            "8,16",
            "--set",
            "cache.hot_bytes=8388608",
            "--json",
            str(tmp_path / "sim.json"),
        ],
    )
    assert ok.exit_code == 0, ok.output
    assert "changed cache.hot_bytes=8388608" in ok.output  # the human summary names the what-if
    assert '"hot_bytes": 8388608' in (tmp_path / "sim.json").read_text()


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("mysql://u@h/db", "unsupported database URL mysql://u@h/db"),
        ("foo://x", "unsupported database URL foo://x"),
        ("not a url", "not a database URL: 'not a url'"),
    ],
)
def test_db_upgrade_names_an_unusable_url(url: str, needle: str) -> None:
    _one_line_error(runner.invoke(app, ["db", "upgrade", "--db-url", url]), needle)


def test_db_upgrade_names_a_directory_it_cannot_make(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    url = f"sqlite:///{blocker}/sub/kvpilot.db"
    _one_line_error(runner.invoke(app, ["db", "upgrade", "--db-url", url]), f"the directory {blocker}/sub")
    made = runner.invoke(app, ["db", "upgrade", "--db-url", f"sqlite:///{tmp_path}/new/dir/kvpilot.db"])
    assert made.exit_code == 0 and f"made the directory {tmp_path}/new/dir" in made.output


def test_loadtest_against_a_dead_target_stops_at_once() -> None:
    import time

    t0 = time.monotonic()
    result = runner.invoke(app, ["loadtest", "--target", "http://127.0.0.1:1", "--duration", "30s", "--no-progress"])
    _one_line_error(result, "--target: cannot connect to http://127.0.0.1:1: connection refused")
    assert time.monotonic() - t0 < 10
