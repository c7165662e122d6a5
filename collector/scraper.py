"""Periodic scrape of Prometheus text endpoints into canonical `series_points`, with target health.

One scraper per deployment: with several collectors on one PostgreSQL, run it on one of them
(`KVPILOT_SCRAPE_ENABLED=false` on the others) or targets are scraped once per collector.
Each scrape is one transaction: its points, its `up`/`scrape_duration_seconds` and the target's health.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, insert, select, update

from collector.db import translate_errors
from collector.errors import CollectorError
from collector.schema import ScrapeTarget, SeriesPoint
from collector.series import labels_json, map_samples

log = logging.getLogger(__name__)

MAX_SCRAPE_BYTES = 16 * 2**20
_NO_LABELS = labels_json({})


@dataclass(frozen=True)
class ScrapeOutcome:
    target_id: int
    url: str
    up: bool
    points: int
    duration_s: float
    error: str | None


class ScrapeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.scrapes = Counter("kvpilot_collector_scrapes", "scrapes by result", ["result"], registry=registry)
        self.points = Counter("kvpilot_collector_scrape_points", "canonical points stored", registry=registry)


def parse_exposition(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format -> flat (sample name, labels, value); raises ValueError on bad input."""
    samples = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.append((sample.name, dict(sample.labels), float(sample.value)))
    return samples


class Scraper:
    def __init__(
        self,
        engine: Engine,
        *,
        timeout_s: float = 5.0,
        metrics: ScrapeMetrics | None = None,
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
        tick_s: float = 0.5,
        max_workers: int = 8,
    ) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.client = client or httpx.Client(timeout=timeout_s, follow_redirects=False)
        self.clock = clock
        self.tick_s = tick_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvpilot-scrape")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- one scrape -------------------------------------------------------------------------------

    def _fetch(self, url: str) -> str:
        with self.client.stream("GET", url, headers={"Accept": "text/plain;version=0.0.4"}) as resp:
            if resp.status_code != 200:
                raise CollectorError(f"HTTP {resp.status_code}")
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > MAX_SCRAPE_BYTES:
                    raise CollectorError(f"response larger than {MAX_SCRAPE_BYTES} bytes")
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")

    def scrape(self, target: ScrapeTarget) -> ScrapeOutcome:
        started = self.clock()
        t0 = time.perf_counter()
        error: str | None = None
        points = []
        try:
            points = map_samples(parse_exposition(self._fetch(target.url)))
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        except (CollectorError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        duration = time.perf_counter() - t0
        up = error is None
        rows = [
            {"instance": target.instance, "name": p.name, "labels": p.labels, "ts": started, "value": p.value}
            for p in points
        ]
        rows.append(
            {
                "instance": target.instance,
                "name": "up",
                "labels": _NO_LABELS,
                "ts": started,
                "value": 1.0 if up else 0.0,
            }
        )
        rows.append(
            {
                "instance": target.instance,
                "name": "scrape_duration_seconds",
                "labels": _NO_LABELS,
                "ts": started,
                "value": duration,
            }
        )
        for row in rows:
            row["target_id"] = target.id
        t = ScrapeTarget.__table__
        with translate_errors(), self.engine.begin() as conn:
            conn.execute(insert(SeriesPoint.__table__), rows)
            conn.execute(
                update(t)
                .where(t.c.id == target.id)
                .values(up=up, last_error=error, last_scrape_at=started, scrape_duration_s=duration)
            )
        if error:
            log.warning("scrape of %s failed: %s", target.url, error)
        if self.metrics:
            self.metrics.scrapes.labels("success" if up else "failure").inc()
            self.metrics.points.inc(len(points))
        return ScrapeOutcome(target.id, target.url, up, len(points), duration, error)

    # --- scheduling --------------------------------------------------------------------------------

    def due_targets(self, now: float) -> list[ScrapeTarget]:
        t = ScrapeTarget.__table__
        with translate_errors(), self.engine.connect() as conn:
            rows = conn.execute(select(t).where(t.c.enabled.is_(True))).all()
        targets = [ScrapeTarget(**row._asdict()) for row in rows]
        return [x for x in targets if x.last_scrape_at is None or x.last_scrape_at + x.interval_s <= now]

    def run_once(self, now: float | None = None) -> list[ScrapeOutcome]:
        """Scrape every due target concurrently; returns when all are stored."""
        due = self.due_targets(self.clock() if now is None else now)
        return list(self._pool.map(self.scrape, due))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except CollectorError as exc:
                log.error("scrape round failed: %s", exc)
            self._stop.wait(self.tick_s)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvpilot-scraper", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 2)
            self._thread = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
