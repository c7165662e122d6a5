"""`kvpilot bench` comes from the `kvpilot.bench` entry point: the CLI never imports the benchmarks package."""

from __future__ import annotations

import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import typer
from typer.testing import CliRunner

from benchmarks.cli import bench_app
from kvpilot.cli_plugins import BENCH_GROUP, NOT_INSTALLED, mount_bench

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _declared() -> list[EntryPoint]:
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    return [EntryPoint(name, value, BENCH_GROUP) for name, value in groups[BENCH_GROUP].items()]


def _cli(points: list[EntryPoint]) -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """A stand-in for kvpilot's top-level app."""

    mount_bench(app, found=lambda: points)
    return app


def test_pyproject_declares_the_benchmarks_app() -> None:
    (point,) = _declared()
    assert point.load() is bench_app


def test_the_declared_app_is_mounted_as_bench() -> None:
    res = runner.invoke(_cli(_declared()), ["bench", "--help"])
    assert res.exit_code == 0
    for command in ("engine", "vllm", "alerts", "ingest", "sim", "tuner", "tune-vllm"):
        assert command in res.output


def test_without_the_entry_point_bench_says_what_to_install() -> None:
    res = runner.invoke(_cli([]), ["bench", "engine", "--quick", "--json", "x.json"])
    assert res.exit_code == 2 and NOT_INSTALLED in res.output and "Traceback" not in res.output


def test_an_entry_point_that_does_not_load_is_named() -> None:
    broken = EntryPoint("benchmarks", "benchmarks.no_such_module:bench_app", BENCH_GROUP)
    res = runner.invoke(_cli([broken]), ["bench", "tuner"])
    assert res.exit_code == 2 and "benchmarks.no_such_module:bench_app" in res.output


def test_bench_tune_vllm_that_cannot_measure_says_why_without_a_traceback(tmp_path: Path) -> None:
    """A failure inside the bench (here: no vLLM interpreter) is a message and exit 1, and the JSON file keeps
    the plan with `status: failed` and the error."""
    import json

    from kvpilot.cli import app

    out_json = tmp_path / "tv.json"
    out = runner.invoke(
        app,
        ["bench", "tune-vllm", "--quick", "--vllm-python", str(tmp_path / "no-python"), "--json", str(out_json)],
    )
    assert out.exit_code == 1, out.output
    assert "kvpilot bench tune-vllm:" in out.output and "no-python" in out.output
    assert "Traceback" not in out.output
    written = json.loads(out_json.read_text())
    assert written["status"] == "failed" and "no-python" in written["error"] and written["plan"]


def test_every_bench_json_carries_the_load_average_unless_it_measured_its_own(tmp_path: Path) -> None:
    import json

    from benchmarks import cli as bench_cli

    bench_cli._bench()  # what `kvpilot bench ...` runs before its command
    bench_cli.emit({"figure": 1.0}, tmp_path / "a.json")
    load = json.loads((tmp_path / "a.json").read_text())["load_average"]
    assert len(load["start"]) == len(load["end"]) == 3 and load["cpus"] >= 1
    bench_cli.emit({"figure": 1.0, "load_average_at_start": 0.5}, tmp_path / "b.json")
    assert "load_average" not in json.loads((tmp_path / "b.json").read_text())
