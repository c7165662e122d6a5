"""README's "Observe a vLLM server", run as a newcomer runs it, against a real vLLM.

The section's two `sh` blocks (start, then stop) are read out of README.md and fed line by line to one bash,
as a terminal paste would be, in a fresh directory that stands for the clone: `kvpilot` on the PATH (the venv
the tests run in, as `. .venv/bin/activate` puts it there), vLLM where the README says `kvpilot vllm serve`
finds it (`./.venv-vllm`, or `$KVPILOT_VLLM_PYTHON` when the developer set it), and an environment that is
empty but for PATH, HOME and a developer's PYTHONPATH. The bash runs in a network namespace of its own
(`unshare -rn`) so the README's fixed ports (8000, 8100, 8501, 9093) cannot collide with anything else on
the machine; where namespaces are not allowed it runs in this one, and fails naming a port that is taken.

Between the blocks the test checks, from the database the README's commands made: vLLM's /metrics scraped
(series with vLLM's `engine` and `model_name` labels and the `--label node=...`), one request row per request
the load test had answered (from vLLM's spans), one step row per iteration line in vLLM's log, and the alert
evaluator holding its lease; through the same shell, the alerts API and the dashboard answering. After the stop
block: vLLM exited 0 with its spool empty, the lease handed back, every background job gone. (Whether
`kvpilot vllm serve` removes its scrape target on a clean stop is not checked here.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from collector.db import make_engine
from tests.vllm.peer import ITERATION, REPO, STARTUP_TIMEOUT_S, vllm_python

pytestmark = pytest.mark.vllm

SECTION = "## Observe a vLLM server"
INSTANCE = "vllm-a"  # as the README's block names it
PORTS = (8000, 8100, 8501, 9093)
STARTED, STOPPED = "__readme_started__", "__readme_stopped__"


def readme_blocks(readme: Path = REPO / "README.md") -> list[str]:
    """The `sh` blocks of the section (up to its first subsection), in order: the start block and the stop block."""
    content = readme.read_text(encoding="utf-8")
    start = content.index(SECTION + "\n")
    end = content.find("\n##", start + len(SECTION))  # the next heading, a subsection's too
    section = content[start : end if end > 0 else len(content)]
    return re.findall(r"^```sh\n(.*?)^```$", section, flags=re.M | re.S)


def test_the_sections_blocks_are_found_and_are_bash() -> None:
    blocks = readme_blocks()
    assert len(blocks) == 2, blocks
    start, stop = blocks
    for block in blocks:
        subprocess.run(["bash", "-n"], input=block.encode(), check=True)
    assert "kvpilot vllm serve" in start and "kvpilot collector serve" in start and "kvpilot alerts run" in start
    assert "kill %3" in stop  # job 3 is `kvpilot vllm serve`: stopped first


class Shell:
    """One bash fed from a pipe, in the clone directory; its output (and the probes') in `out`."""

    def __init__(self, clone: Path, env: dict[str, str], isolated: bool) -> None:
        self.out = clone / "shell.out"
        prefix = ["unshare", "-rn", "sh", "-c", "ip link set lo up && exec bash -s"] if isolated else ["bash", "-s"]
        with self.out.open("wb") as fh:
            self.proc = subprocess.Popen(
                prefix, cwd=clone, env=env, stdin=subprocess.PIPE, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def send(self, lines: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(lines.encode() + b"\n")
        self.proc.stdin.flush()

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, marker: str, timeout_s: float) -> re.Match[str]:
        """The first line `marker ...` the shell printed; fails if the shell exits or time runs out."""
        pattern = re.compile(rf"^{marker}(.*)$", re.M)
        deadline = time.monotonic() + timeout_s
        while True:
            if found := pattern.search(self.output()):
                return found
            if self.proc.poll() is not None:
                pytest.fail(f"the shell exited with {self.proc.returncode} before {marker}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {marker} within {timeout_s:.0f} s:\n{self.output()[-4000:]}")
            time.sleep(1.0)

    def probe(self, name: str, url: str) -> int:
        """The HTTP status of `url` as seen from the shell's network (0: no answer within a minute)."""
        self.send(f"echo {name} $(curl -s -o /dev/null -w '%{{http_code}}' --retry 30 --retry-delay 2 "
                  f"--retry-all-errors {url})")  # fmt: skip
        return int(self.wait_for(name, 120.0)[1].split()[-1])


def _namespaces_allowed() -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        probe = ["unshare", "-rn", "ip", "link", "set", "lo", "up"]  # as the shell's own start does
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    return False


def _taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _newcomer_env(clone: Path, python: str) -> dict[str, str]:
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "kvpilot").exists():
        pytest.fail(f"no kvpilot script next to {sys.executable} (pip install -e . makes it)")
    env = {"PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}
    for name in ("HOME", "PYTHONPATH"):  # vLLM's compile cache lives under HOME; a worktree's code wins
        if os.environ.get(name):
            env[name] = os.environ[name]
    if os.environ.get("KVPILOT_VLLM_PYTHON"):
        env["KVPILOT_VLLM_PYTHON"] = python
    else:  # `make vllm-venv` made it in the clone
        (clone / ".venv-vllm").symlink_to(Path(python).parent.parent)
    return env


def _query(db_url: str, sql: str, **params: object) -> list:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql), params).all())
    finally:
        engine.dispose()


def _until(what: str, check, timeout_s: float = 90.0):
    """Poll `check()` (a (done, detail) pair) until done; fail with the last detail."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, detail = check()
        if done:
            return detail
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: {detail}")
        time.sleep(1.0)


def _iteration_lines(log: Path) -> int:
    with log.open("rb") as fh:
        return sum(1 for line in fh if ITERATION.search(line))


def test_the_readme_observes_a_real_vllm_from_start_to_finish(tmp_path: Path) -> None:
    python = vllm_python()
    start_block, stop_block = readme_blocks()
    clone = tmp_path / "clone"
    clone.mkdir()
    env = _newcomer_env(clone, python)
    isolated = _namespaces_allowed()
    if not isolated and (busy := [p for p in PORTS if _taken(p)]):
        pytest.fail(f"the README's ports {busy} are taken here, and `unshare -rn` (a network of its own) is refused")
    db_url = f"sqlite:///{clone / 'kvpilot-data' / 'kvpilot.db'}"
    vllm_log = clone / "vllm.log"
    shell = Shell(clone, env, isolated)
    try:
        shell.send(start_block)
        shell.send(f"jobs -p > pids.txt; echo {STARTED} $?")
        shell.wait_for(STARTED, STARTUP_TIMEOUT_S + 240.0)
        out = shell.output()
        answered = re.search(r"requests\s+sent (\d+), answered (\d+)", out)
        assert answered, f"no load test summary in the shell's output:\n{out[-4000:]}"
        sent, ok = int(answered[1]), int(answered[2])
        assert sent == ok > 0, out[-4000:]
        tokens = re.search(r"tokens planned/served\s+prompt (\d+)/(\d+), output (\d+)/(\d+)", out)
        assert tokens and tokens[1] == tokens[2] and tokens[3] == tokens[4], out[-4000:]  # vLLM got the plan
        pids = [int(p) for p in (clone / "pids.txt").read_text().split()]
        assert len(pids) == 4, pids  # collector, alerts, vLLM, dashboard

        # vLLM's /metrics, scraped with its own labels and the target's
        def scraped() -> tuple[bool, object]:
            rows = _query(db_url, "SELECT DISTINCT labels FROM series_points WHERE instance = :i AND name = 'kv_usage'",
                          i=INSTANCE)  # fmt: skip
            labels = [json.loads(r[0]) for r in rows]
            return any({"engine", "model_name"} <= set(lab) and lab.get("node") for lab in labels), labels

        labels = _until("vLLM's kv_usage series stored with engine, model_name and node labels", scraped)
        assert all(lab["node"] == socket.gethostname() for lab in labels), labels

        def requests() -> tuple[bool, int]:
            stored = _query(db_url, "SELECT count(*) FROM requests WHERE instance = :i", i=INSTANCE)[0][0]
            return stored == ok, stored

        _until(f"request rows from vLLM's spans, one per request answered ({ok})", requests)

        def steps() -> tuple[bool, tuple[int, int]]:
            stored = _query(db_url, "SELECT count(*) FROM steps WHERE instance = :i", i=INSTANCE)[0][0]
            lines = _iteration_lines(vllm_log)
            return stored == lines > 0, (stored, lines)

        _until("step rows, one per iteration line in vllm.log (stored, lines)", steps)
        lease = _query(db_url, "SELECT holder, expires_at FROM alert_evaluator_lease")
        assert len(lease) == 1 and lease[0][1] > time.time(), lease  # the evaluator holds it
        assert shell.probe("__alerts_api__", "http://127.0.0.1:9093/api/v2/alerts") == 200
        assert shell.probe("__dashboard__", "http://127.0.0.1:8501/_stcore/health") == 200

        shell.send(stop_block)
        shell.send(f"echo {STOPPED}; exit")
        shell.wait_for(STOPPED, 180.0)
        assert shell.proc.wait(timeout=60) == 0
        launcher = vllm_log.read_text(errors="replace")
        assert re.search(r"kvpilot: vLLM exited with 0; (\d+) iteration lines, \1 steps \(\d+ acknowledged, "
                         r"0 batch\(es\) waiting in the spool\), 0 unparsable", launcher), launcher[-3000:]  # fmt: skip
        final = _query(db_url, "SELECT count(*) FROM steps WHERE instance = :i", i=INSTANCE)[0][0]
        assert final == _iteration_lines(vllm_log), "steps lost at shutdown"
        assert _query(db_url, "SELECT expires_at FROM alert_evaluator_lease")[0][0] == 0.0  # handed back
        alive = [pid for pid in pids if _alive(pid)]
        assert not alive, f"background jobs still running after the stop block: {alive}"
        assert not _alive(_vllm_pid(vllm_log)), "vLLM itself is still running"
    finally:
        _kill_all(shell, vllm_log)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(") ")[-1].startswith("Z"))


def _vllm_pid(vllm_log: Path) -> int | None:
    found = re.search(rb"started vLLM \(pid (\d+)\)", vllm_log.read_bytes()) if vllm_log.exists() else None
    return int(found[1]) if found else None


def _kill_all(shell: Shell, vllm_log: Path) -> None:
    """Whatever a failed run left: vLLM's own process group (its session), then the shell's."""
    for pid in filter(None, [_vllm_pid(vllm_log), shell.proc.pid]):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        shell.proc.wait(timeout=10)
