"""Engines the load tester starts itself (--quick without --target, --cold-start, --fault): a real
`kvpilot engine serve` child process on a free loopback port, stopped when the context ends.

The tiny model (dim 64, 2 layers) keeps a CPU run short; `--engine-config` replaces it with any
EngineConfig YAML (a tuning proposal included).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from plumbing.process import ProcessStartError, free_port, spawn, stop_process, wait_healthy

TINY_ENGINE: dict = {
    "device": "cpu",
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "max_position": 1024},
    "warmup": {"requests": 8},  # a served engine is warm; --cold-start measures the difference
    "telemetry": {"sink": "none"},
}


def merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_engine_config(path: Path | None) -> dict:
    if path is None:
        return copy.deepcopy(TINY_ENGINE)
    from engine.config import EngineConfig

    return EngineConfig.from_yaml(path).model_dump(mode="json")  # raises ConfigError naming the field


@dataclass
class LocalEngine:
    url: str
    port: int
    proc: subprocess.Popen
    workdir: Path
    log_path: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, timeout_s)

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def start_engine(
    config: dict, *, workdir: Path | None = None, timeout_s: float = 120.0, name: str = "engine"
) -> LocalEngine:
    """Write `config` (an EngineConfig dict) to a file, serve it on a free port, wait for /health.

    ProcessStartError (with the tail of the engine's log) when it exits first or does not answer in time."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvpilot-loadtest-"))
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = merge(config, {"server": {"host": "127.0.0.1", "port": port}})
    cfg_path = workdir / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log_path = workdir / f"{name}.log"
    # the child runs in `workdir`; keep this checkout importable there (editable installs list packages
    # as they were at install time)
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    command = [
        sys.executable,
        "-m",
        "kvpilot.cli",
        "engine",
        "serve",
        "--config",
        str(cfg_path),
        "--log-level",
        "warning",
    ]
    proc = spawn(command, log_path=log_path, env=env, cwd=workdir)
    engine = LocalEngine(f"http://127.0.0.1:{port}", port, proc, workdir, log_path)
    try:
        wait_healthy(f"{engine.url}/health", proc, timeout_s=timeout_s, what=name, log_path=log_path)
    except ProcessStartError:
        engine.stop()
        raise
    return engine
