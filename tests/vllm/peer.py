"""One real vLLM for the whole test session, started the way an operator starts it: `kvpilot vllm serve`.

The session fixture `vllm_peer` (tests/conftest.py) makes a checkpoint with `kvpilot model init`, starts a
collector subprocess on a migrated SQLite file (restartable on the same port, for the spool test), then
`python -m kvpilot.cli vllm serve --collector ... -- --model <ckpt> ...` on a free loopback port, and waits
for vLLM's /health and its scrape target. vLLM finds its interpreter as the CLI does: $KVPILOT_VLLM_PYTHON,
else ./.venv-vllm (`make vllm-venv`). Missing: the vllm tests skip with the reason, or fail under
KVPILOT_REQUIRE_VLLM=1 (CI). The KV cache is 16 MiB (`--kv-cache-memory-bytes`; VLLM_CPU_KVCACHE_SPACE is
removed from vLLM's environment because it would override that): 64 blocks of 128 tokens, so a handful of
requests moves the KV usage. Logs: `vllm.log` (vLLM's output) and `kvpilot.log` (the launcher's stderr) in
the session's temp directory; failures print where.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from collector.db import make_engine
from collector.server import CollectorProcess, start_subprocess
from collector.settings import CollectorSettings
from integrations.vllm.wiring import VllmSetupError, find_vllm_python
from kvpilot.cli import app
from plumbing.process import ProcessStartError, free_port, spawn, stop_process, wait_healthy

REPO = Path(__file__).resolve().parents[2]
REQUIRE_ENV = "KVPILOT_REQUIRE_VLLM"
MODEL = "tiny-llama"
INSTANCE = "vllm-test"
TOKEN = "vllm-peer-token"
ADMIN_TOKEN = "vllm-peer-admin-token"
LABELS = {"node": "ci-node"}
KV_CACHE_BYTES = 16 * 2**20
STARTUP_TIMEOUT_S = 420.0  # ~40 s with vLLM's compile cache warm, ~70 s cold, on 2 cores
ITERATION = re.compile(rb"Iteration\(\d+\): ")


def _missing(reason: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(reason)


def vllm_python() -> str:
    """The interpreter with vLLM, or skip/fail (KVPILOT_REQUIRE_VLLM=1) saying what is missing."""
    try:
        python = find_vllm_python(root=REPO)
    except VllmSetupError as exc:
        _missing(str(exc))
    probe = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        timeout=60,
    )
    if probe.returncode != 0:
        _missing(f"{python} cannot import vllm (make vllm-venv installs it)")
    return python


@dataclass
class VllmPeer:
    url: str  # vLLM's OpenAI server
    checkpoint: Path
    db_url: str
    collector_settings: CollectorSettings
    collector: CollectorProcess | None
    proc: subprocess.Popen[bytes]  # `kvpilot vllm serve`
    vllm_log: Path
    kvpilot_log: Path
    spool_dir: Path

    @property
    def collector_url(self) -> str:
        return f"http://127.0.0.1:{self.collector_settings.port}"

    def where(self) -> str:
        return f"(logs: {self.vllm_log}, {self.kvpilot_log})"

    def complete(self, client: httpx.Client, prompt: str, max_tokens: int, **extra: object) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        resp = client.post(f"{self.url}/v1/completions", json={**body, **extra}, timeout=120.0)
        assert resp.status_code == 200, (resp.status_code, resp.text[:500], self.where())
        return resp.json()

    def iteration_lines(self) -> int:
        """Counted in vLLM's raw output, independently of the adapter's parser."""
        with self.vllm_log.open("rb") as fh:
            return sum(1 for line in fh if ITERATION.search(line))

    def query(self, sql: str, **params: object) -> list:
        engine = make_engine(self.db_url)
        try:
            with engine.connect() as conn:
                return list(conn.execute(text(sql), params).all())
        finally:
            engine.dispose()

    def stored_steps(self) -> int:
        return self.query("SELECT count(*) FROM steps WHERE instance = :i", i=INSTANCE)[0][0]

    def stop_collector(self) -> None:
        if self.collector is not None:
            self.collector.stop()
            self.collector = None

    def start_collector(self) -> None:
        if self.collector is None:
            self.collector = start_subprocess(
                self.collector_settings, log_path=self.vllm_log.with_name("collector.log")
            )

    def settled_lines(self, quiet_s: float = 1.0, timeout_s: float = 30.0) -> int:
        """The iteration line count once it stopped growing: vLLM logs a step's line after it answered."""
        deadline = time.monotonic() + timeout_s
        count, since = self.iteration_lines(), time.monotonic()
        while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
            time.sleep(0.1)
            if (now := self.iteration_lines()) != count:
                count, since = now, time.monotonic()
        return count

    def wait_steps_stored(self, timeout_s: float = 60.0) -> tuple[int, int]:
        """Until every iteration line so far is a stored step row; (stored, lines) when that holds or time is up."""
        deadline = time.monotonic() + timeout_s
        lines = self.settled_lines()
        while True:
            stored = self.stored_steps()
            if stored == lines or time.monotonic() > deadline:
                return stored, self.settled_lines()
            time.sleep(0.25)


def start_peer(tmp: Path, sqlite_template: Path) -> VllmPeer:
    python = vllm_python()
    checkpoint = tmp / MODEL
    made = CliRunner().invoke(app, ["model", "init", str(checkpoint), "--seed", "0"])
    assert made.exit_code == 0, made.output
    db = tmp / "kvpilot.db"
    shutil.copyfile(sqlite_template, db)
    # Registering vLLM's /metrics is administration (the admin token); a loopback target must be allowed.
    settings = CollectorSettings(
        db_url=f"sqlite:///{db}",
        ingest_token=TOKEN,
        admin_token=ADMIN_TOKEN,
        scrape_allow_nets="127.0.0.0/8",
        port=free_port(),
        log_level="warning",
        scrape_timeout_s=2.0,
    )
    vllm_log, kvpilot_log = tmp / "vllm.log", tmp / "kvpilot.log"
    peer_collector = start_subprocess(settings, log_path=tmp / "collector.log")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    labels = [arg for name, value in LABELS.items() for arg in ("--label", f"{name}={value}")]
    command = [
        sys.executable, "-m", "kvpilot.cli", "vllm", "serve",
        "--collector", f"http://127.0.0.1:{settings.port}", "--ingest-token", TOKEN, "--admin-token", ADMIN_TOKEN,
        "--instance", INSTANCE,
        "--run-id", "vllm-session", *labels, "--scrape-interval", "1", "--vllm-python", python,
        "--spool-dir", str(tmp / "spool"), "--log-file", str(vllm_log),
        "--",
        "--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    proc = spawn(command, log_path=kvpilot_log, env=env, cwd=tmp)
    peer = VllmPeer(
        url=f"http://127.0.0.1:{port}",
        checkpoint=checkpoint,
        db_url=settings.db_url,
        collector_settings=settings,
        collector=peer_collector,
        proc=proc,
        vllm_log=vllm_log,
        kvpilot_log=kvpilot_log,
        spool_dir=tmp / "spool",
    )
    try:
        _wait_ready(peer)
    except BaseException:
        stop_peer(peer)
        raise
    return peer


def _wait_ready(peer: VllmPeer) -> None:
    """Serving, and registered (the launcher registers vLLM's /metrics once it has read its KV block count)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        wait_healthy(
            f"{peer.url}/health",
            peer.proc,
            timeout_s=STARTUP_TIMEOUT_S,
            what="kvpilot vllm serve",
            log_path=peer.kvpilot_log,
            poll_s=0.5,
        )
    except ProcessStartError as exc:
        pytest.fail(f"{exc}\n{peer.where()}")
    with httpx.Client(timeout=2.0) as client:
        while not _registered(client, peer):
            if peer.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vLLM's /metrics not registered within {STARTUP_TIMEOUT_S:.0f}s {peer.where()}")
            time.sleep(0.5)


def _registered(client: httpx.Client, peer: VllmPeer) -> bool:
    try:
        resp = client.get(f"{peer.collector_url}/v1/targets", headers={"Authorization": f"Bearer {TOKEN}"})
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and any(t["url"] == f"{peer.url}/metrics" for t in resp.json())


def stop_peer(peer: VllmPeer) -> int | None:
    """SIGTERM to `kvpilot vllm serve` (it forwards it to vLLM), SIGKILL past a minute; its exit code."""
    code = None
    if peer.proc.poll() is None:
        stop_process(peer.proc, timeout_s=60)
        code = peer.proc.returncode
        if code == -signal.SIGKILL:  # the launcher was killed: vLLM's process group outlives it
            _kill_orphaned_vllm(peer)
    peer.stop_collector()
    return code


def _kill_orphaned_vllm(peer: VllmPeer) -> None:
    """vLLM runs in its own process group; with its launcher killed, end that group (pid from the log)."""
    found = re.search(rb"started vLLM \(pid (\d+)\)", peer.kvpilot_log.read_bytes())
    if found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(found[1]), signal.SIGKILL)
