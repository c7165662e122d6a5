"""Replay a workload through vLLM's OpenAI API at the recorded arrival times.

Each request is a `/v1/completions` call with a token-id prompt of the recorded length (the same deterministic ids
the kvpilot replay uses, `engine.workload.prompt_ids`), `max_tokens` the recorded completion length and
`ignore_eos`, so every request produces exactly its recorded tokens. One asyncio loop sends them all on time
(a late send is counted, not hidden: `max_send_lag_s`), so the client stays light next to the server on a small
CPU. What vLLM refuses (HTTP 4xx/5xx) is counted as rejected, what never got an answer (connection error,
timeout) as failed; the latency figures themselves come from vLLM's own spans in the collector, not from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from engine import workload as W

log = logging.getLogger("kvpilot.integrations.vllm.client")


@dataclass
class ClientResult:
    sent: int = 0
    ok: int = 0
    rejected: int = 0  # vLLM answered with an error status
    failed: int = 0  # no answer: connection refused or reset, timeout
    output_tokens: int = 0
    wall_start: float = 0.0  # epoch seconds of arrival 0
    wall_end: float = 0.0  # when the last answer came
    max_send_lag_s: float = 0.0  # how late the latest request left (the client's own overload)
    # epoch seconds at which each request's POST started, by workload index (None: never sent): the traffic
    # vLLM was offered, which a loaded client sends later than planned (`tuner.vllm.fidelity` simulates it)
    sent_at: list[float | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few, for the trial's reason

    @property
    def duration_s(self) -> float:
        return self.wall_end - self.wall_start


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


async def _send(
    client: httpx.AsyncClient, url: str, body: dict, result: ClientResult, sem: asyncio.Semaphore, index: int
) -> None:
    async with sem:
        result.sent_at[index] = time.time()
        try:
            resp = await client.post(url, json=body)
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
    with contextlib.suppress(ValueError, KeyError, TypeError):
        result.output_tokens += int(resp.json()["usage"]["completion_tokens"])


async def _replay(
    base_url: str,
    model: str,
    requests: Sequence[W.WorkloadRequest],
    prompts: Sequence[list[int]],
    *,
    priorities: bool,
    timeout_s: float,
    max_in_flight: int,
) -> ClientResult:
    result = ClientResult(sent_at=[None] * len(requests))
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    sem = asyncio.Semaphore(max_in_flight)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.05
        result.wall_start = time.time() + 0.05
        tasks = []
        for i in order:
            req = requests[i]
            delay = t0 + req.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            result.max_send_lag_s = max(result.max_send_lag_s, loop.time() - t0 - req.arrival_s)
            body = completion_body(model, prompts[i], req.output_tokens, priority=req.priority if priorities else None)
            tasks.append(asyncio.create_task(_send(client, url, body, result, sem, i)))
            result.sent += 1
        await asyncio.gather(*tasks)
    result.wall_end = time.time()
    return result


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
    """Send every request at its arrival time (relative to now) and wait for all answers."""
    if len(requests) != len(prompts):
        raise ValueError(f"{len(requests)} requests but {len(prompts)} prompts")
    result = asyncio.run(
        _replay(
            base_url,
            model,
            requests,
            prompts,
            priorities=priorities,
            timeout_s=timeout_s,
            max_in_flight=max_in_flight,
        )
    )
    if result.max_send_lag_s > 0.25:
        log.warning("replay: the client sent a request %.2f s late (the machine is overloaded)", result.max_send_lag_s)
    return result


def warm_up(base_url: str, model: str, *, requests: int = 4, prompt_tokens: int = 64, max_tokens: int = 8) -> None:
    """A few concurrent requests before the measured replay, as a freshly started server would get."""
    reqs = [W.WorkloadRequest(0.0, prompt_tokens, max_tokens) for _ in range(requests)]
    prompts = [W.prompt_ids(r, i, seed=987_654) for i, r in enumerate(reqs)]
    result = replay_openai(base_url, model, reqs, prompts, timeout_s=120.0)
    if result.ok != requests:
        raise RuntimeError(f"warm-up: {result.ok}/{requests} requests answered: {'; '.join(result.errors)}")
