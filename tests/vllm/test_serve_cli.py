"""`kvpilot vllm serve` passes vLLM's output and exit code through when vLLM refuses its arguments.

The session's vLLM (tests/vllm/test_live.py) covers a serving run and a SIGTERM ending in exit code 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.peer import REPO, vllm_python

pytestmark = pytest.mark.vllm


def test_vllm_refusing_its_arguments_is_its_exit_code_and_its_message(tmp_path: Path) -> None:
    python = vllm_python()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [
        sys.executable, "-m", "kvpilot.cli", "vllm", "serve", "--vllm-python", python,
        "--collector", "http://127.0.0.1:9", "--spool-dir", str(tmp_path / "spool"), "--instance", "broken",
        "--", "--model", str(tmp_path), "--dtype", "nonsense",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, timeout=120, cwd=tmp_path)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err[-2000:]
    assert "argument --dtype: invalid choice: 'nonsense'" in err  # vLLM's own words, passed through
    assert "kvpilot: vLLM exited with 2; 0 iteration lines, 0 steps" in err
