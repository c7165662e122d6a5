"""vLLM in the benchmarks: a plain OpenAI server (no kvpilot wiring), and a client sending token-id prompts.

"Plain" is vLLM as an operator runs it without kvpilot: no iteration-detail log, no OTLP traces, no scrape
target (vLLM's own periodic stats line stays on, as by default). `kvpilot bench engine` measures it against
kvpilot's engine and `kvpilot bench vllm` against the same vLLM wired by `kvpilot vllm serve`.

vLLM's CPU build binds its model threads to all cores but one and leaves that one to its API server
(`VLLM_CPU_OMP_THREADS_BIND=auto`); on 2 cores that is one model core. Binding both (reserving none) was 10x
slower on this project's 2-core machine (the spinning OpenMP threads fight the API server), so the
benchmarks keep vLLM's default. A server can be paused (SIGSTOP to its process group) while another engine
is measured, so that its idle loops and scrapes take nothing from that measurement.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from integrations.vllm.wiring import API_SERVER_MODULE, VllmSetupError, find_vllm_python
from plumbing.process import spawn, wait_healthy

SERVED_NAME = "bench"
STARTUP_TIMEOUT_S = 600.0  # ~90 s on a loaded 2-core machine (torch.compile of the model at start)


def vllm_python_or_reason(explicit: str | None = None) -> tuple[str | None, str | None]:
    """(interpreter, None) when one with vLLM is found, else (None, why not)."""
    try:
        python = find_vllm_python(explicit)
    except VllmSetupError as exc:
        return None, str(exc)
    probe = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return None, f"{python} cannot import vllm (make vllm-venv installs it)"
    return python, None


def server_args(
    checkpoint: Path,
    *,
    port: int,
    max_model_len: int,
    kv_cache_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    served_name: str = SERVED_NAME,
) -> list[str]:
    """vLLM's arguments for a benchmark: the engine's limits, float32, no prefix cache (kvpilot's is off too)."""
    return [
        "--model", str(checkpoint), "--served-model-name", served_name, "--dtype", "float32",
        "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
        "--no-enable-prefix-caching", "--disable-uvicorn-access-log", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def server_env() -> dict[str, str]:
    """This process's environment without VLLM_CPU_KVCACHE_SPACE, which would override --kv-cache-memory-bytes."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}


def signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread, so the `finally` that stops the vLLM servers (each in its
    own process group, out of reach of a signal to ours) runs before the benchmark exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class PlainVllm:
    """`python -m vllm.entrypoints.openai.api_server ARGS` in its own process group, output to `log_path`."""

    python: str
    args: Sequence[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> PlainVllm:
        """Start and wait for /health; `startup_s` is the time that took."""
        t0 = time.perf_counter()
        command = [self.python, "-m", API_SERVER_MODULE, *self.args]
        self.proc = spawn(command, log_path=self.log_path, env=server_env(), new_session=True)
        try:
            wait_healthy(
                f"{self.url}/health", self.proc, timeout_s=timeout_s, what="vLLM", log_path=self.log_path, poll_s=0.5
            )
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def pause(self) -> None:
        if self.proc is not None:
            signal_group(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            signal_group(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        self.resume()
        signal_group(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        deadline = time.monotonic() + 5.0  # its engine-core and worker children exit with it, or are killed
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.1)
        else:
            signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10.0)


# --- the client ---------------------------------------------------------------------------------------


@dataclass
class Burst:
    """Requests sent all at once and answered: output tokens, wall time, per-request latency."""

    tokens: int
    wall_s: float
    e2e_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


async def _burst(
    url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], timeout_s: float
) -> Burst:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(ids: Sequence[int], n: int) -> tuple[int, float]:
            body = {"model": model, "prompt": list(ids), "max_tokens": n, "ignore_eos": True, "temperature": 0.0}
            resp = await client.post(f"{url}/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"vLLM answered {resp.status_code}: {resp.text[:300]}")
            got = int(resp.json()["usage"]["completion_tokens"])
            if got != n:
                raise RuntimeError(f"vLLM made {got} tokens where {n} were asked (ignore_eos)")
            return got, time.perf_counter() - t0

        done = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens, strict=True)))
        wall = time.perf_counter() - t0
    return Burst(sum(t for t, _ in done), wall, [e for _, e in done])


def send_burst(
    url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    *,
    model: str = SERVED_NAME,
    timeout_s: float = 900.0,
) -> Burst:
    """Every prompt (token ids) at t=0 through /v1/completions, greedy with `ignore_eos`; wall time to the last."""
    return asyncio.run(_burst(url, model, prompts, max_tokens, timeout_s))
