"""The `live` backend: try a config on a running engine, observe a window, roll back.

Each trial PUTs the config's tunables to /admin/config, waits `settle_s`, then observes `window_s`
of the engine's traffic as the collector stored it (instance filter, every run of the instance). The
original tunables are restored after every trial — also when the trial fails or is interrupted — and
a failed rollback stops the study. Guard limits end a trial early: a rejection rate or p99 TTFT over
the guard while observing (checked every `guard_interval_s`). `drive=True` sends the study's workload
to the engine's /generate while observing (for staging engines without production traffic).
`measure_requests` instead sends one given request list at its arrival times (e.g. the workload at a multiple
of its rate, `tuner.capacity.at_rate`) under the config and measures the window until the last answer. Either
way the requests go out open-loop (`plumbing.openloop`), at most `drive_concurrency` in flight.

The engine stores a row for every request it answers, a 429 of its admission control included; a request that
failed on the wire or was answered with another error never becomes a row, so `measure_requests` counts those
against the config (`tuner.metrics.with_unrecorded`: as the vLLM backend does) with a WARNING line, and
`lost_requests` totals them (the drive's as well).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import httpx
from sqlalchemy import Engine

from engine import workload as W
from engine.config import EngineConfig
from plumbing.openloop import Fired, lateness, open_loop
from tuner.metrics import SLO, TrialMetrics, trial_metrics, with_unrecorded
from tuner.replay import Prepared, prepared_workload

log = logging.getLogger("kvpilot.tuner.live")


class LiveError(RuntimeError):
    """The engine could not be reconfigured or restored."""


class LiveBackend:
    name = "live"

    def __init__(
        self,
        *,
        db: Engine,
        slo: SLO,
        workload: Callable[[int], list[W.WorkloadRequest]],
        engine_url: str,
        instance: str,
        admin_token: str | None = None,
        window_s: float = 30.0,
        settle_s: float = 5.0,
        guard_rejection_rate: float = 0.2,
        guard_p99_ttft_s: float | None = None,
        guard_interval_s: float = 2.0,
        drive: bool = False,
        drive_concurrency: int = 16,
        timeout_s: float = 10.0,
        ingest_lag_s: float = 2.0,
        client: httpx.Client | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if window_s <= 0 or settle_s < 0:
            raise ValueError("window_s must be positive and settle_s >= 0")
        self.db, self.slo, self.workload = db, slo.validate(), workload
        self.instance = instance
        self.window_s, self.settle_s = window_s, settle_s
        self.guard_rejection_rate = guard_rejection_rate
        self.guard_p99_ttft_s = guard_p99_ttft_s if guard_p99_ttft_s is not None else 5 * slo.ttft_s
        self.guard_interval_s = guard_interval_s
        self.drive, self.drive_concurrency = drive, drive_concurrency
        self.ingest_lag_s = ingest_lag_s
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = client or httpx.Client(base_url=engine_url, timeout=timeout_s, headers=self.headers)
        self.transport = transport  # the requests' (`client` carries the admin calls): tests serve the app in process
        self.engine_url = engine_url
        self.original: dict[str, Any] | None = None
        self.aborted_trials = 0
        self.trials = 0
        self.lost_requests = 0  # sent but never answered, or answered with an error other than the 429 stored
        self._workloads: dict[int, Prepared] = {}

    def requests(self, seed: int) -> Prepared:
        """The workload of `seed` and its prompts' token ids (what a capacity search replays at multiples)."""
        return prepared_workload(self._workloads, self.workload, seed)

    def _call(self, method: str, path: str, json: Any = None) -> dict:
        try:
            resp = self.http.request(method, path, json=json)
        except httpx.HTTPError as exc:
            raise LiveError(f"{method} {self.engine_url}{path} failed: {exc}") from exc
        if resp.status_code >= 400:
            raise LiveError(f"{method} {self.engine_url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def evaluate(self, config: EngineConfig, *, run_id: str, seed: int) -> TrialMetrics:
        current = self._call("GET", "/admin/config")["tunable"]
        if self.original is None:
            self.original = current
        self.trials += 1
        stop = threading.Event()
        driver = None
        try:
            self._call("PUT", "/admin/config", json=config.tunable())
            log.info("live trial %s: applied %s", run_id, config.tunable())
            if self.drive:
                driver = threading.Thread(target=self._drive, args=(self.workload(seed), stop), daemon=True)
                driver.start()
            time.sleep(self.settle_s)
            start = time.time()
            end = start + self.window_s
            while time.time() < end:
                time.sleep(min(self.guard_interval_s, max(0.0, end - time.time())))
                if self._guard_tripped(start, time.time(), run_id):
                    end = time.time()
                    self.aborted_trials += 1
                    break
        finally:
            stop.set()
            if driver is not None:
                driver.join(timeout=30)
            self.restore()
        time.sleep(self.ingest_lag_s)  # the engine's HTTP sink flushes about every second
        return trial_metrics(self.db, run_id=None, start=start, end=end, slo=self.slo, instances=[self.instance])

    def measure_requests(
        self, config: EngineConfig, reqs: list[W.WorkloadRequest], prompts: list[list[int]], *, run_id: str
    ) -> TrialMetrics:
        """`reqs` sent at their arrivals with `config` applied, every answer awaited, then rolled back."""
        if len(prompts) != len(reqs):
            raise ValueError(f"prompts: one per request, got {len(prompts)} for {len(reqs)}")
        current = self._call("GET", "/admin/config")["tunable"]
        if self.original is None:
            self.original = current
        self.trials += 1
        try:
            self._call("PUT", "/admin/config", json=config.tunable())
            log.info("live replay %s: applied %s, %d requests", run_id, config.tunable(), len(reqs))
            time.sleep(self.settle_s)
            start = time.time()
            fired, answers = self._fire([r.arrival_s for r in reqs], lambda i: (prompts[i], reqs[i].output_tokens))
            log.info("live replay %s: p99 send lateness %s s", run_id, lateness(fired.late_s).p99_s)
            end = time.time()
        finally:
            self.restore()
        time.sleep(self.ingest_lag_s)
        m = trial_metrics(self.db, run_id=None, start=start, end=end, slo=self.slo, instances=[self.instance])
        return with_unrecorded(m, refused=0, lost=self._lost(run_id, answers))

    def _lost(self, run_id: str, answers: Counter[str]) -> int:
        """The requests of `answers` (by outcome) that the engine stored no row for, counted and logged."""
        lost = sum(n for outcome, n in answers.items() if outcome not in ("ok", "429"))
        if lost:
            self.lost_requests += lost
            log.warning("live %s: %d request(s) lost (%s)", run_id, lost, dict(answers))
        return lost

    def _guard_tripped(self, start: float, now: float, run_id: str) -> bool:
        if now - start < self.guard_interval_s:
            return False
        m = trial_metrics(self.db, run_id=None, start=start, end=now, slo=self.slo, instances=[self.instance])
        if m.requests and m.rejection_rate > self.guard_rejection_rate:
            log.warning(
                "live trial %s: guard tripped: rejection rate %.2f > %.2f; rolling back",
                run_id,
                m.rejection_rate,
                self.guard_rejection_rate,
            )
            return True
        if m.ttft_p99_s is not None and m.ttft_p99_s > self.guard_p99_ttft_s:
            log.warning(
                "live trial %s: guard tripped: p99 TTFT %.2f s > %.2f s; rolling back",
                run_id,
                m.ttft_p99_s,
                self.guard_p99_ttft_s,
            )
            return True
        return False

    def restore(self) -> None:
        """Put the engine's original tunables back; a failure here stops the study (raised)."""
        if self.original is None:
            return
        try:
            self._call("PUT", "/admin/config", json=self.original)
        except LiveError as exc:
            log.critical("live: rollback to the original config FAILED: %s", exc)
            raise
        log.info("live: rolled back to the original config")

    def _drive(self, reqs: list[W.WorkloadRequest], stop: threading.Event) -> None:
        """The workload over and over (each pass a second after the last arrival of the one before) until `stop`."""
        n, period = len(reqs), reqs[-1].arrival_s + 1.0
        offsets = ((i // n) * period + reqs[i % n].arrival_s for i in itertools.count())
        _, answers = self._fire(
            offsets, lambda i: (W.prompt_ids(reqs[i % n], i), reqs[i % n].output_tokens), stop=stop.is_set
        )
        self._lost("drive", answers)

    def _fire(
        self,
        offsets: Iterable[float],
        request: Callable[[int], tuple[list[int], int]],
        *,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[Fired[None], Counter[str]]:
        """Request i (its prompt's token ids, its max tokens) sent to /generate at its offset from now; every
        answer awaited, counted by outcome: `ok`, the HTTP status of an error answer, or `wire` (no answer)."""
        answers: Counter[str] = Counter()

        async def run() -> Fired[None]:
            client = httpx.AsyncClient(
                base_url=self.engine_url, timeout=120.0, headers=self.headers, transport=self.transport
            )
            async with client as http:

                async def send(i: int) -> None:
                    ids, max_tokens = request(i)
                    try:
                        resp = await http.post(
                            "/generate", json={"prompt": _text(ids), "max_tokens": max_tokens, "ignore_eos": True}
                        )
                    except httpx.HTTPError as exc:
                        answers["wire"] += 1
                        log.debug("live driver: request failed: %s", exc)
                        return
                    answers["ok" if resp.is_success else str(resp.status_code)] += 1

                return await open_loop(offsets, send, max_in_flight=self.drive_concurrency, stop=stop)

        return asyncio.run(run()), answers


def _text(ids: list[int]) -> str:
    """A prompt for /generate from token ids (the byte tokenizer's printable range; the BOS id dropped)."""
    return "".join(chr(32 + (b % 95)) for b in ids[1:])
