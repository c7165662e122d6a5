"""Store the load test's per-request results through the collector, as `request` wire events.

Results are queued as they finish and POSTed to /v1/ingest in batches, each with its own
`Idempotency-Key` that stays the same on every retry, so a batch whose 202 was lost (the collector
was killed after COMMIT) is stored once. A batch is retried with backoff until `drain()`'s deadline;
`acknowledged` counts events in batches the collector answered 2xx for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import httpx

from engine.events import RequestEvent, event_to_json
from kvpilot.loadtest.client import RequestResult

log = logging.getLogger(__name__)
RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})


def to_event(res: RequestResult, *, instance: str, run_id: str, wall_t0: float) -> RequestEvent:
    """A RequestEvent from the client's view; stage durations from the server's timings when it sent them."""
    status = {"ok": "finished", "refused": "rejected"}.get(res.outcome, "failed")
    srv = res.server
    e2e = res.e2e_s
    ttft = res.ttft_s

    def stage(name: str, default: float = 0.0) -> float:
        value = srv.get(name)
        return max(0.0, float(value)) if isinstance(value, int | float) else default

    return RequestEvent(
        instance=instance,
        run_id=run_id,
        ts=wall_t0 + res.end_s,
        request_id=res.request_id,
        status=status,
        prompt_tokens=res.served_prompt_tokens if res.served_prompt_tokens is not None else res.prompt_tokens,
        output_tokens=res.output_tokens,
        frontend_s=0.0,  # the client's clock: its TTFT and e2e already hold everything before the engine
        queue_s=stage("queue_s"),
        prefill_s=stage("prefill_s"),
        ttft_s=max(0.0, ttft) if ttft is not None else None,
        decode_s=stage("decode_s", max(0.0, e2e - ttft) if ttft is not None else 0.0),
        e2e_s=e2e,
        preemptions=int(stage("preemptions")),
        swaps=int(stage("swaps")),
        finish_reason=res.outcome if status != "finished" else None,
    )


@dataclass
class Publisher:
    client: httpx.AsyncClient
    collector_url: str
    run_id: str
    wall_t0: float
    instance: str = "loadtest"
    token: str | None = None
    batch_size: int = 200
    flush_interval_s: float = 0.5
    queued: list[dict] = field(default_factory=list)
    acknowledged: int = 0
    duplicates: int = 0
    retries: int = 0
    batches: int = 0
    last_error: str | None = None
    _pending: list[tuple[str, list[dict]]] = field(default_factory=list)
    _seq: int = 0
    _backoff_s: float = 0.2
    _next_try: float = 0.0

    def add(self, res: RequestResult) -> None:
        event = to_event(res, instance=self.instance, run_id=self.run_id, wall_t0=self.wall_t0)
        self.queued.append(event_to_json(event))

    @property
    def unsent(self) -> int:
        return len(self.queued) + sum(len(ev) for _, ev in self._pending)

    def _cut(self) -> None:
        while self.queued:
            chunk, self.queued = self.queued[: self.batch_size], self.queued[self.batch_size :]
            self._pending.append((f"loadtest-{self.run_id}-{self._seq}", chunk))
            self._seq += 1

    async def flush_once(self) -> bool:
        """Send what is pending, oldest first; False if the collector could not take it now."""
        self._cut()
        if self._pending and time.monotonic() < self._next_try:
            return False
        while self._pending:
            key, events = self._pending[0]
            headers = {"Idempotency-Key": key}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            try:
                resp = await self.client.post(
                    self.collector_url.rstrip("/") + "/v1/ingest",
                    json={"events": events},
                    headers=headers,
                    timeout=10.0,
                )
            except httpx.HTTPError as exc:
                return self._failed(f"{type(exc).__name__}: {exc}")
            if resp.status_code in RETRYABLE:
                return self._failed(f"HTTP {resp.status_code}: {resp.text[:200]}")
            if resp.status_code >= 300:
                raise PublishError(f"collector refused batch {key} (HTTP {resp.status_code}): {resp.text[:300]}")
            if resp.status_code == 200:
                self.duplicates += 1
            self.acknowledged += len(events)
            self.batches += 1
            self._pending.pop(0)
            self._backoff_s = 0.2
        return True

    def _failed(self, why: str) -> bool:
        self.retries += 1
        self.last_error = why
        self._next_try = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, 2.0)
        log.info("collector unavailable (%s); will retry", why)
        return False

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.flush_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.flush_interval_s)

    async def drain(self, timeout_s: float) -> bool:
        """Send everything left, retrying until `timeout_s`; True when nothing is left unacknowledged."""
        deadline = time.monotonic() + timeout_s
        while True:
            if await self.flush_once() and not self.unsent:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


class PublishError(RuntimeError):
    """The collector refused results for good (a wrong token, a batch it cannot validate)."""
