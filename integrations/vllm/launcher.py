"""`kvpilot vllm serve`: run vLLM's OpenAI server with its telemetry wired to the collector.

The launcher starts vLLM (`wiring.build_command`/`build_env`), reads its merged stdout/stderr line by line
on one thread — each line is stamped the moment it arrives, goes on to `passthrough` (the launcher's
stderr) and an optional log file, and each iteration line becomes a step event (`integrations.vllm.iteration_log`)
placed at the time the step ran (`StepPlacer`, from the time vLLM prefixed the line with) for the engine's
HTTP sink (batches, an on-disk spool and retries: a collector that is down loses nothing) — on a second
thread waits for /health, reads the KV block count from /metrics and registers /metrics as a scrape
target, retrying while the collector is unreachable, and on a third releases the placed steps once no
later line can move them.

vLLM runs in its own session (process group), so a terminal's Ctrl-C reaches the launcher only and is
forwarded once; `stop()` sends SIGTERM and, past the grace period, SIGKILLs the whole group (vLLM's
engine-core and worker children included).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import httpx

from engine.http_sink import HttpSink, SpoolLockedError, spool_dir_for
from engine.sinks import EventSink
from integrations.vllm.iteration_log import IterationStep, StepPlacer, VllmLogParser, VllmLogStats, step_event
from integrations.vllm.wiring import (
    Endpoint,
    TargetRegistrationError,
    VllmSetupError,
    build_command,
    build_env,
    delete_target,
    read_kv_capacity,
    register_target,
    stopped_cleanly,
)
from plumbing.process import ProcessStartError, wait_healthy

log = logging.getLogger("kvpilot.vllm")

MAX_READ_BYTES = 64 * 1024  # one read of vLLM's output; a longer line arrives in pieces
TAIL_LINES = 40  # kept for the error message when vLLM dies before serving
CAPACITY_WAIT_S = 5.0
MAX_HELD_LINES = 50_000
RELEASE_EVERY_S = 0.5


class VllmExitedError(RuntimeError):
    """vLLM exited (or never answered) before serving; the message ends with its last lines."""


@dataclass(frozen=True)
class LaunchOptions:
    vllm_args: Sequence[str]
    python: str
    collector_url: str
    ingest_token: str | None = None
    admin_token: str | None = None  # the collector's admin token: registering a scrape target is administration
    instance: str | None = None  # default: <hostname>:<port>
    run_id: str | None = None  # default: a fresh one per launch
    labels: Mapping[str, str] = field(default_factory=dict)
    scrape_interval_s: float | None = None  # default: the collector's
    spool_dir: Path | None = Path("kvpilot-data/spool")  # None: spool in memory (lost at exit)
    log_file: Path | None = None
    traces: bool = True
    flush_interval_s: float = 1.0
    env: Mapping[str, str] | None = None  # vLLM's base environment; default: this process's


class VllmLauncher:
    def __init__(
        self, options: LaunchOptions, *, passthrough: BinaryIO | None = None, sink: EventSink | None = None
    ) -> None:
        self.options = options
        self.endpoint = Endpoint.from_args(options.vllm_args)
        self.collector_url = options.collector_url.rstrip("/")
        self.instance = options.instance or f"{os.uname().nodename}:{self.endpoint.port}"
        self.run_id = options.run_id or f"vllm-{uuid.uuid4().hex[:12]}"
        self.parser = VllmLogParser(instance=self.instance, run_id=self.run_id)
        self.placer = StepPlacer()
        self._placing = threading.Lock()  # the parser, the placer and the held lines
        self._held: list[tuple[str, float]] = []  # lines read before the KV block count was known
        self._held_since = 0.0
        traces_endpoint = f"{self.collector_url}/v1/traces" if options.traces else None
        self.command = build_command(options.python, options.vllm_args, traces_endpoint=traces_endpoint)
        self.env = build_env(
            options.env if options.env is not None else os.environ,
            instance=self.instance,
            run_id=self.run_id,
            token=options.ingest_token,
            traces=options.traces,
        )
        self.passthrough = passthrough
        self._sink = sink
        self.target: str | None = None  # 'created' / 'exists' once registered; 'deleted' after a clean stop
        self._signals_sent: set[int] = set()  # what we asked vLLM to stop with: its exit by one is clean
        self.proc: subprocess.Popen[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._log_fh: BinaryIO | None = None
        self._closed = False

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def stats(self) -> VllmLogStats:
        return self.parser.stats

    @property
    def sink(self) -> EventSink:
        assert self._sink is not None, "start() first"
        return self._sink

    def start(self) -> VllmLauncher:
        if self._sink is None:
            spool = spool_dir_for(self.options.spool_dir, self.instance) if self.options.spool_dir else None
            try:
                self._sink = HttpSink(
                    self.collector_url,
                    token=self.options.ingest_token,
                    flush_interval_s=self.options.flush_interval_s,
                    spool_dir=spool,
                )
            except SpoolLockedError as exc:
                raise VllmSetupError(f"{exc} (another launcher for instance {self.instance}?)") from None
        if self.options.log_file is not None:
            self.options.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = self.options.log_file.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            self.close()
            raise VllmSetupError(f"cannot start {self.command[0]}: {exc.strerror or exc}") from None
        log.info("started vLLM (pid %d) as instance %s, run %s", self.proc.pid, self.instance, self.run_id)
        threads = (
            (self._pump, "kvpilot-vllm-log"),
            (self._watch, "kvpilot-vllm-watch"),
            (self._release, "kvpilot-vllm-steps"),
        )
        for target, name in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Block until vLLM answers /health (and its KV capacity was read); raise if it dies or times out."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise VllmExitedError(f"vLLM exited with {code} before serving; its last lines:\n{self.last_lines()}")
            if time.monotonic() > deadline:
                raise VllmExitedError(f"vLLM did not answer {self.url}/health within {timeout_s:.0f}s")

    def last_lines(self) -> str:
        return "\n".join(self._tail)

    def send_signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signals_sent.add(signum)
            self.proc.send_signal(signum)

    def wait(self, timeout_s: float | None = None) -> int:
        """vLLM's exit code (negative: killed by that signal) once it exited and its output was read."""
        assert self.proc is not None, "start() first"
        code = self.proc.wait(timeout=timeout_s)
        self._reap_group(grace_s=5.0)
        self._threads[0].join(timeout=10.0)  # the pump reads to EOF
        return code

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM vLLM, SIGKILL its group past `timeout_s`; then flush the telemetry. Idempotent."""
        code = None
        if self.proc is not None:
            self.send_signal(signal.SIGTERM)
            try:
                code = self.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("vLLM did not stop within %.0fs; killing its process group", timeout_s)
                self.kill()
                code = self.wait(10.0)
        self.close()
        return code

    def close(self) -> None:
        """Stop the threads, take the scrape target away after a clean stop, and flush the sink (what the
        collector did not take stays in the spool)."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        for thread in self._threads[1:]:
            thread.join(timeout=5.0)
        with self._placing:
            self._parse_held(force=True)
            self._emit(self.placer.flush())
        self._deregister()
        if self._sink is not None:
            self._sink.close()
        if self._log_fh is not None:
            self._log_fh.close()

    # --- threads ------------------------------------------------------------------------------------

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        out = self.proc.stdout
        while raw := out.readline(MAX_READ_BYTES):
            read_ts = time.time()  # before anything below can hold the line up
            for stream in (self.passthrough, self._log_fh):
                if stream is not None:
                    try:
                        stream.write(raw)
                        stream.flush()
                    except (OSError, ValueError):  # a closed terminal must not stop the telemetry
                        pass
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self._tail.append(line)
            with self._placing:
                self._parse(line, read_ts)
        with self._placing:
            self._parse_held(force=True)
            self._emit(self.placer.flush())

    def _parse(self, line: str, read_ts: float) -> None:
        """Feed one line; hold it (and every line after it, in order) while the KV block count is unknown.

        A step served in the moment between vLLM's first /health and the read of its KV block count waits
        (bounded by CAPACITY_WAIT_S) for that count rather than ship in other units; the lines wait, not the
        reading: a stalled reader would fill the pipe and stall vLLM's own logging.
        """
        if self._held or ("Iteration(" in line and not self._ready.is_set()):
            if not self._held:
                self._held_since = time.monotonic()
            self._held.append((line, read_ts))
            self._parse_held(force=len(self._held) >= MAX_HELD_LINES)
            return
        if (step := self.parser.feed(line, read_ts=read_ts)) is not None:
            self._emit(self.placer.push(step))

    def _parse_held(self, *, force: bool = False) -> None:
        """Feed the held lines once the capacity is known or the wait is over (or `force`)."""
        if not self._held:
            return
        waited_out = time.monotonic() - self._held_since > CAPACITY_WAIT_S
        if not (force or self._ready.is_set() or waited_out):
            return
        if not self._ready.is_set():
            log.warning(
                "vLLM's KV block count is still unknown; %d line(s) read before it count KV in tokens", len(self._held)
            )
        held, self._held = self._held, []
        for line, read_ts in held:
            if (step := self.parser.feed(line, read_ts=read_ts)) is not None:
                self._emit(self.placer.push(step))

    def _release(self) -> None:
        while not self._stopping.wait(RELEASE_EVERY_S):
            with self._placing:
                self._parse_held()
                self._emit(self.placer.release(time.time()))

    def _emit(self, steps: list[IterationStep]) -> None:
        """Hand placed steps to the sink (the caller holds `_placing`: parser, placer and held lines)."""
        if self._sink is not None:
            for step in steps:
                self._sink.emit(step_event(step))

    def _watch(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            if not self._await_health():
                return
            try:
                blocks, block_size = read_kv_capacity(client, f"{self.url}/metrics")
                self.parser.set_capacity(blocks=blocks, block_size=block_size)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("could not read vLLM's KV block count from /metrics (%s); counting KV in tokens", exc)
            self._ready.set()
            self._register(client)

    def _await_health(self) -> bool:
        """True once vLLM answers /health; False when it exited first (`wait_ready` says so) or on `close()`."""
        try:
            return wait_healthy(
                f"{self.url}/health", self.proc, timeout_s=math.inf, what="vLLM", poll_s=0.5, stop=self._stopping
            )
        except ProcessStartError:
            return False

    def _register(self, client: httpx.Client) -> None:
        if not self.options.admin_token:
            log.warning(
                "no collector admin token (--admin-token / KVPILOT_ADMIN_TOKEN): %s/metrics is not registered as a "
                "scrape target; KV usage, queue and preemptions of this vLLM will not be stored",
                self.url,
            )
            return
        delay, warned = 0.5, False
        while not self._stopping.is_set():
            try:
                self.target = register_target(
                    client,
                    self.collector_url,
                    token=self.options.admin_token,
                    metrics_url=f"{self.url}/metrics",
                    instance=self.instance,
                    labels=self.options.labels,
                    interval_s=self.options.scrape_interval_s,
                )
                log.info("scrape target %s/metrics %s on %s", self.url, self.target, self.collector_url)
                return
            except TargetRegistrationError as exc:
                log.error("%s", exc)
                return
            except httpx.HTTPError as exc:
                if not warned:
                    log.warning("collector %s unreachable (%s); will keep trying to register", self.collector_url, exc)
                    warned = True
            self._stopping.wait(delay)
            delay = min(delay * 2, 30.0)

    def _deregister(self) -> None:
        """After a clean stop (vLLM exited 0 or by the signal it was sent) delete its scrape target: nobody
        is paged for an engine that was shut down. After a crash the target stays, so ScrapeTargetDown pages."""
        code = None if self.proc is None else self.proc.poll()
        if self.target is None or not self.options.admin_token:
            return
        if not stopped_cleanly(code, self._signals_sent):
            log.warning("vLLM exited with %s unasked: its scrape target stays registered (it will page)", code)
            return
        try:
            with httpx.Client(timeout=5.0) as client:
                delete_target(
                    client, self.collector_url, token=self.options.admin_token, metrics_url=f"{self.url}/metrics"
                )
        except (httpx.HTTPError, TargetRegistrationError, ValueError, TypeError, KeyError) as exc:
            log.warning("scrape target %s/metrics left on the collector %s: %s", self.url, self.collector_url, exc)
            return
        self.target = "deleted"
        log.info("vLLM stopped cleanly: scrape target %s/metrics deleted from %s", self.url, self.collector_url)

    # --- process group ------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL vLLM's whole process group (its engine-core and worker children too)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def _reap_group(self, grace_s: float) -> None:
        """vLLM's children should exit with it; any still in its group after `grace_s` are killed."""
        if self.proc is None:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)
        log.warning("vLLM's children outlived it; killing its process group")
        self.kill()
