"""The base install runs the collector, the alerts, `kvpilot status` and the tokens commands without torch,
Streamlit or Optuna; a command that needs an extra says which and exits non-zero (kvpilot/cli_extras.py).

The CLI runs in a child interpreter whose first meta-path finder refuses those three packages, as if the
extras were not installed, and reports each refused import on stderr (so a swallowed ImportError shows too).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from kvpilot.cli_extras import EXTRA_MODULES
from plumbing.process import free_port, spawn, stop_process, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
REFUSED = ("torch", "streamlit", "optuna")
REFUSED_MARK = "refused import:"

WITHOUT_EXTRAS = f"""
import importlib.abc
import sys


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {REFUSED!r}:
            print("{REFUSED_MARK}", name, file=sys.stderr)
            raise ImportError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Refuse())
"""

# `python -c CLI ARGS` is `kvpilot ARGS`.
CLI = WITHOUT_EXTRAS + 'import runpy\nsys.argv[0] = "kvpilot"\nrunpy.run_module("kvpilot.cli", run_name="__main__")\n'

# Several commands in one child (each start costs seconds); prints [{code, stdout, stderr}] as JSON.
EACH = (
    WITHOUT_EXTRAS
    + """
import contextlib
import io
import json

from kvpilot.cli import app

results = []
real_stdout = sys.stdout
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            app(args, prog_name="kvpilot")
        except SystemExit as exc:
            code = exc.code or 0
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results), file=real_stdout)
"""
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def kvpilot_each(commands: list[list[str]], cwd: Path) -> list[dict[str, Any]]:
    """Each `kvpilot ARGS` of `commands`, in order, in one child without the extras."""
    child = [sys.executable, "-c", EACH, json.dumps(commands)]
    result = subprocess.run(child, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert REFUSED_MARK not in result.stderr, f"importing kvpilot.cli tried an extra: {result.stderr}"
    return json.loads(result.stdout)


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in requirements}  # type: ignore[union-attr]  # every requirement starts with a name


def test_the_collector_serves_without_the_extras(sqlite_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "collector.log"
    args = ["collector", "serve", "--port", str(port), "--db-url", sqlite_url, "--no-scrape"]
    proc = spawn([sys.executable, "-c", CLI, *args], log_path=log, env=_env(), cwd=tmp_path)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s=90, what="collector", log_path=log)
    finally:
        stop_process(proc)
    output = log.read_text()
    assert REFUSED_MARK not in output, output


def test_base_commands_run_without_the_extras(sqlite_url: str, tmp_path: Path) -> None:
    tokens = str(tmp_path / "tokens.yml")
    commands = [
        ["--help"],
        ["collector", "serve", "--help"],
        ["alerts", "--help"],
        ["alerts", "check"],
        ["status", "--db-url", sqlite_url],
        ["collector", "tokens", "add", "ci", "--file", tokens],
        ["collector", "tokens", "list", "--file", tokens],
    ]
    results = kvpilot_each(commands, tmp_path)
    for args, result in zip(commands, results, strict=True):
        assert result["code"] == 0, (args, result)
        assert REFUSED_MARK not in result["stderr"], (args, result["stderr"])
    assert "kvpilot status" in results[4]["stdout"] and "ci" in results[6]["stdout"]


def test_a_command_without_its_extra_names_the_install(tmp_path: Path) -> None:
    commands = {"engine": ["engine", "serve"], "dashboard": ["dashboard"], "tune": ["tune", "proposals", "list"]}
    results = kvpilot_each(list(commands.values()), tmp_path)
    for (extra, args), result in zip(commands.items(), results, strict=True):
        assert result["code"] == 1, (args, result)
        line = f"`kvpilot {' '.join(args)}` needs the {extra} extra: pip install 'kvpilot[{extra}]'"
        assert line in result["stderr"] and "Traceback" not in result["stderr"], result["stderr"]


def test_the_engine_scheduler_and_kv_cache_import_without_torch() -> None:
    """The simulator shares them with the engine; keeping them torch-free keeps that split possible."""
    code = WITHOUT_EXTRAS + "import engine.config, engine.kv, engine.scheduler, engine.sequence\n"
    result = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and REFUSED_MARK not in result.stderr, result.stderr


def test_pyproject_keeps_torch_streamlit_and_optuna_in_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    heavy = {module for modules in EXTRA_MODULES.values() for module in modules} | {"altair", "matplotlib"}
    assert not _names(project["dependencies"]) & heavy
    extras = project["optional-dependencies"]
    assert "torch==2.13.0" in extras["engine"]  # a looser pin pulls several GB of CUDA wheels
    assert {"streamlit", "altair"} <= _names(extras["dashboard"])
    assert "optuna" in _names(extras["tune"]) and "kvpilot[engine]" in extras["tune"]
    assert extras["all"] == ["kvpilot[engine,dashboard,tune]"]
    assert set(EXTRA_MODULES) <= set(extras)
