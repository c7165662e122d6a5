"""Periodic scrape of Prometheus text endpoints into canonical `series_points`, with target health.

One scraper per deployment: with several collectors on one PostgreSQL, run it on one of them
(`KVPILOT_SCRAPE_ENABLED=false` on the others) or targets are scraped once per collector.
Each scrape is one transaction: its points, its `up`/`scrape_duration_seconds`/`scrape_series_dropped`,
the target's health and the upsert of its instance into `instances`.

Every stored point carries the target's static labels (`scrape_targets.labels`). As Prometheus does with
`honor_labels: false`, a scraped label that collides with a target label is kept as `exported_<name>`
and the target's value wins.

Cardinality is bounded per scrape. A series with more than `MAX_LABELS` labels or a label value longer
than `MAX_LABEL_VALUE_CHARS` is dropped (never truncated: two series cut to one prefix would merge).
Beyond the target's `sample_limit` distinct series the excess is dropped, where Prometheus would fail the
whole scrape: an exporter growing a high-cardinality family should not blank out the utilization and
queue gauges the alerts depend on. What is kept is deterministic and the same scrape after scrape:
gauges and counters before histogram buckets, then by name and label set, and a histogram is never kept
in part. Such a scrape stays `up` but is marked degraded (`last_error` says how many series were kept);
every drop is counted in `kvpilot_collector_scrape_series_dropped_total{reason}`, stored as the
`scrape_series_dropped` series, and logged as one warning line per target and scrape.

What one scrape may cost is bounded before it is spent: the body is read and inflated a step at a time
to at most 16 MiB (one content coding at most), parsing stops past `parse_cap(sample_limit)` samples,
and the deadline covers the read, the inflation and the parse. Past any bound the scrape fails (`up` 0,
`last_error` naming the bound, never what the target sent), counted in
`kvpilot_collector_scrape_bound_failures_total{bound}` and logged.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, select, update

from collector.bulk import insert_rows, many_rows_params
from collector.db import translate_errors
from collector.errors import CollectorError
from collector.exposition import Point, labels_json, map_samples
from collector.ingest import upsert_statement
from collector.netpolicy import AddressPolicy, AddressRefusedError, ResolutionError
from collector.redact import redact_text, redact_url
from collector.schema import ScrapeTarget, SeriesPoint
from collector.scrapebody import BOUNDS, BoundedBody, ScrapeError

log = logging.getLogger(__name__)

DEFAULT_SAMPLE_LIMIT = 10_000
MAX_SAMPLE_LIMIT = 1_000_000
MIN_PARSE_CAP = 20_000
MAX_LABELS = 32
MAX_LABEL_VALUE_CHARS = 256
_POINT_COLUMNS = ("instance", "name", "labels", "ts", "value", "target_id")
DROP_REASONS = ("sample_limit", "label_count", "label_value_length")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Names a target label may not take: they are columns of their own or have a meaning on buckets.
_RESERVED_LABELS = frozenset({"instance", "job", "le"})


class TargetLabelsError(ValueError):
    """A scrape target's static labels or sample limit are not acceptable; the message names the offender."""


def validate_target_labels(labels: Mapping[str, str]) -> str:
    """Check a target's static labels and return their stored form (`scrape_targets.labels`).

    Names match `[a-zA-Z_][a-zA-Z0-9_]*`, do not start with `__` (Prometheus' reserved prefix) and are
    not `instance`, `job` or `le`; values are non-empty strings of at most 256 characters without NUL;
    at most 32 labels.
    """
    if len(labels) > MAX_LABELS:
        raise TargetLabelsError(f"at most {MAX_LABELS} target labels, got {len(labels)}")
    for name, value in labels.items():
        if not isinstance(name, str) or not _LABEL_NAME.match(name) or name.startswith("__"):
            raise TargetLabelsError(f"label name {name!r} must match [a-zA-Z_][a-zA-Z0-9_]* and not start with __")
        if name in _RESERVED_LABELS:
            raise TargetLabelsError(f"label name {name!r} is reserved")
        if not isinstance(value, str) or not value or len(value) > MAX_LABEL_VALUE_CHARS or "\x00" in value:
            raise TargetLabelsError(
                f"label {name!r}: the value must be a non-empty string of at most {MAX_LABEL_VALUE_CHARS}"
                " characters without NUL"
            )
    return labels_json(labels)


def validate_sample_limit(limit: int) -> int:
    """A target's `sample_limit`: 1 to MAX_SAMPLE_LIMIT series per scrape (there is no 'unlimited')."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SAMPLE_LIMIT:
        raise TargetLabelsError(f"sample_limit must be an integer from 1 to {MAX_SAMPLE_LIMIT}")
    return limit


@dataclass(frozen=True)
class ScrapeOutcome:
    target_id: int
    url: str
    up: bool
    points: int
    duration_s: float
    error: str | None
    dropped: dict[str, int] = field(default_factory=dict)


class ScrapeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.scrapes = Counter("kvpilot_collector_scrapes", "scrapes by result", ["result"], registry=registry)
        self.points = Counter("kvpilot_collector_scrape_points", "canonical points stored", registry=registry)
        self.series_dropped = Counter(
            "kvpilot_collector_scrape_series_dropped",
            "scraped series not stored, by the bound that dropped them",
            ["reason"],
            registry=registry,
        )
        for reason in DROP_REASONS:
            self.series_dropped.labels(reason)
        self.bound_failures = Counter(
            "kvpilot_collector_scrape_bound_failures",
            "scrapes failed at a bound on what one scrape may cost, by bound",
            ["bound"],
            registry=registry,
        )
        for bound in BOUNDS:
            self.bound_failures.labels(bound)


def parse_exposition(
    text: str, *, max_samples: int | None = None, give_up: float | None = None
) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format -> flat (sample name, labels, value); raises ValueError on bad input, and
    ScrapeError past `max_samples` samples or the monotonic time `give_up` (checked as it parses: a page of
    a million samples took 12 s and 532 MB)."""
    samples = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.append((sample.name, dict(sample.labels), float(sample.value)))
            if max_samples is not None and len(samples) > max_samples:
                raise ScrapeError(f"more than {max_samples} samples", bound="samples")
            if give_up is not None and not len(samples) % 1024 and time.monotonic() > give_up:
                raise ScrapeError("deadline exceeded while parsing", bound="deadline")
    return samples


def parse_cap(sample_limit: int) -> int:
    """Samples parsed at most: past it the scrape fails (as Prometheus does past sample_limit), where
    between `sample_limit` and this the excess is dropped and the scrape stays up."""
    return min(MAX_SAMPLE_LIMIT, max(2 * sample_limit, MIN_PARSE_CAP))


def with_target_labels(labels: Mapping[str, str], target_labels: Mapping[str, str]) -> dict[str, str]:
    """A scraped label set plus the target's: on a collision the scraped one becomes `exported_<name>`."""
    merged = dict(target_labels)
    taken = set(target_labels) | set(labels)
    for name, value in labels.items():
        stored = name
        if name in target_labels:
            stored = f"exported_{name}"
            while stored in taken:  # Prometheus prefixes again until the name is free
                stored = f"exported_{stored}"
            taken.add(stored)
        merged[stored] = value
    return merged


@dataclass(frozen=True)
class BoundedScrape:
    """The series of one scrape to store, `(name, labels JSON, value)`, and what the bounds dropped."""

    series: list[tuple[str, str, float]]
    offered: int
    dropped: dict[str, int]


def _limit_order(point: tuple[str, dict[str, str], float]) -> tuple[bool, str, str, float]:
    """Gauges and counters first, then by name and label set; a histogram's buckets stay together."""
    name, labels, _ = point
    is_bucket = "le" in labels and name.endswith("_bucket")
    rest = labels_json({k: v for k, v in labels.items() if k != "le"}) if is_bucket else labels_json(labels)
    return (is_bucket, name, rest, float(labels["le"]) if is_bucket else 0.0)


def bound_series(points: list[Point], *, target_labels: Mapping[str, str], sample_limit: int) -> BoundedScrape:
    """Merge the target's labels into each point, then apply the label bounds and `sample_limit`."""
    dropped: Tally[str] = Tally()
    candidates: list[tuple[str, dict[str, str], float]] = []
    for p in points:
        labels = with_target_labels(p.labels, target_labels)
        if len(labels) > MAX_LABELS:
            dropped["label_count"] += 1
        elif any(len(v) > MAX_LABEL_VALUE_CHARS for v in labels.values()):
            dropped["label_value_length"] += 1
        else:
            candidates.append((p.name, labels, p.value))
    candidates.sort(key=_limit_order)
    kept = candidates[:sample_limit]
    if len(candidates) > sample_limit:
        cut = _limit_order(candidates[sample_limit])
        if kept and cut[0] and _limit_order(kept[-1])[:3] == cut[:3]:
            kept = [c for c in kept if _limit_order(c)[:3] != cut[:3]]  # no histogram kept in part
        dropped["sample_limit"] += len(candidates) - len(kept)
    return BoundedScrape([(n, labels_json(lab), v) for n, lab, v in kept], len(points), dict(dropped))


def _target_labels(target: ScrapeTarget) -> dict[str, str]:
    """The stored static labels; a malformed value (written around the API) is logged and ignored."""
    try:
        labels = json.loads(target.labels or "{}")
    except ValueError:
        labels = None
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        log.warning("scrape target %s has malformed labels %r; ignored", redact_url(target.url), target.labels)
        return {}
    return labels


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
        policy: AddressPolicy | None = None,
    ) -> None:
        """`policy` says which addresses a target may reach (default: no loopback, link-local, metadata...)."""
        self.engine = engine
        self.policy = policy or AddressPolicy()
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.client = client or httpx.Client(timeout=timeout_s, follow_redirects=False)
        self.clock = clock
        self.tick_s = tick_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvpilot-scrape")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._in_flight: set[int] = set()

    # --- one scrape -------------------------------------------------------------------------------

    def _fetch(self, url: str, deadline_s: float, give_up: float) -> str:
        """The body, or ScrapeError. The deadline bounds the whole read, decompression included: a target
        that trickles a byte every second never trips a read timeout, but it cannot hold a scrape past its
        deadline. The body is inflated here, a step at a time against MAX_SCRAPE_BYTES (httpx would
        inflate a whole network chunk at once: 1,830 bytes of stacked gzip made 2.2 GB), and at most one
        content coding is accepted."""
        # Resolved and checked now, not only when the target was created (DNS rebinding); the connection
        # goes to the checked address.
        pinned = self.policy.pin(url, timeout_s=deadline_s)
        headers = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip", **pinned.headers}
        timeout = httpx.Timeout(deadline_s)
        with self.client.stream(
            "GET", pinned.url, headers=headers, extensions=pinned.extensions, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                raise ScrapeError(f"HTTP {resp.status_code}")
            body = BoundedBody(resp.headers.get_list("content-encoding", split_commas=True), give_up, deadline_s)
            for chunk in resp.iter_raw():
                body.feed(chunk)
        return body.text()

    def deadline_s(self, target: ScrapeTarget) -> float:
        """A scrape ends within its timeout and within its own interval (as Prometheus's scrape_timeout)."""
        return max(0.1, min(self.timeout_s, target.interval_s))

    def scrape(self, target: ScrapeTarget) -> ScrapeOutcome:
        started = self.clock()
        t0 = time.perf_counter()
        error: str | None = None
        points: list[Point] = []
        detail: str | None = None
        # `error` (stored, shown to anyone who lists targets) names only the class of failure and the
        # HTTP status: never the upstream's text (a page that is not an exposition would be echoed) nor
        # the socket error's words (which tell a visitor what listens on a port). The log has the detail.
        limit = target.sample_limit if target.sample_limit and target.sample_limit > 0 else DEFAULT_SAMPLE_LIMIT
        deadline_s = self.deadline_s(target)
        give_up = time.monotonic() + deadline_s
        try:
            text = self._fetch(target.url, deadline_s, give_up)
            points = map_samples(parse_exposition(text, max_samples=parse_cap(limit), give_up=give_up))
        except AddressRefusedError as exc:
            error, detail = "address not allowed", str(exc)
        except ResolutionError as exc:
            error, detail = "connection failed", str(exc)
        except httpx.TimeoutException as exc:
            error, detail = "timeout", f"{type(exc).__name__}: {exc}"
        except httpx.HTTPError as exc:
            error, detail = "connection failed", f"{type(exc).__name__}: {exc}"
        except ScrapeError as exc:
            error = detail = str(exc)
            if self.metrics and exc.bound:
                self.metrics.bound_failures.labels(exc.bound).inc()
        except ValueError as exc:
            error, detail = "not a Prometheus text exposition", f"{type(exc).__name__}: {exc}"
        duration = time.perf_counter() - t0
        up = error is None
        static = _target_labels(target)
        bounded = bound_series(points, target_labels=static, sample_limit=limit)
        n_dropped = sum(bounded.dropped.values())
        synthetic = labels_json(static)
        series = [
            *bounded.series,
            ("up", synthetic, 1.0 if up else 0.0),
            ("scrape_duration_seconds", synthetic, duration),
            ("scrape_series_dropped", synthetic, float(n_dropped)),
        ]
        rows = [(target.instance, n, lab, started, v, target.id) for n, lab, v in series]
        health_error = error
        if up and n_dropped:
            health_error = f"degraded: stored {len(bounded.series)} of {bounded.offered} series ({_reasons(bounded)})"
        t = ScrapeTarget.__table__
        with translate_errors(), self.engine.begin() as conn:
            insert_rows(conn, SeriesPoint.__table__, _POINT_COLUMNS, rows)
            seen = [{"name": target.instance, "first_seen_ts": started, "last_seen_ts": started}]
            conn.execute(
                upsert_statement(conn.dialect.name, "instances"),
                many_rows_params(conn, seen),
            )
            conn.execute(
                update(t)
                .where(t.c.id == target.id)
                .values(up=up, last_error=health_error, last_scrape_at=started, scrape_duration_s=duration)
            )
        if error:
            log.warning("scrape of %s failed: %s", redact_url(target.url), redact_text(detail or ""))
        elif n_dropped:
            log.warning(
                "scrape of %s (instance %s): dropped %d of %d series, sample_limit %d: %s",
                redact_url(target.url),
                target.instance,
                n_dropped,
                bounded.offered,
                limit,
                _reasons(bounded),
            )
        if self.metrics:
            self.metrics.scrapes.labels("success" if up else "failure").inc()
            self.metrics.points.inc(len(bounded.series))
            for reason, n in bounded.dropped.items():
                self.metrics.series_dropped.labels(reason).inc(n)
        shown = redact_url(target.url)
        return ScrapeOutcome(target.id, shown, up, len(bounded.series), duration, error, bounded.dropped)

    # --- scheduling --------------------------------------------------------------------------------

    def due_targets(self, now: float) -> list[ScrapeTarget]:
        """The enabled targets whose interval has passed since their last scrape, picked by the database: the loop
        asks every `tick_s`, and building every target to keep the due ones was 7% of the GIL samples of the
        collector scraping the fleet bench's 100 nodes."""
        t = ScrapeTarget.__table__
        due = t.c.last_scrape_at.is_(None) | (t.c.last_scrape_at + t.c.interval_s <= now)
        with translate_errors(), self.engine.connect() as conn:
            rows = conn.execute(select(t).where(t.c.enabled.is_(True), due)).all()
        return [ScrapeTarget(**row._asdict()) for row in rows]

    def run_once(self, now: float | None = None) -> list[ScrapeOutcome]:
        """Scrape every due target concurrently; returns when all are stored."""
        due = self.due_targets(self.clock() if now is None else now)
        return list(self._pool.map(self.scrape, due))

    def submit_due(self, now: float | None = None) -> int:
        """Start a scrape of every due target that is not being scraped already, without waiting for any:
        each target runs on its own schedule, so a slow one delays nobody else. Returns how many started."""
        due = self.due_targets(self.clock() if now is None else now)
        started = 0
        with self._lock:
            for target in due:
                if target.id in self._in_flight:
                    continue
                self._in_flight.add(target.id)
                self._pool.submit(self._scrape_tracked, target)
                started += 1
        return started

    def _scrape_tracked(self, target: ScrapeTarget) -> None:
        try:
            self.scrape(target)
        except CollectorError as exc:
            log.error("storing the scrape of %s failed: %s", redact_url(target.url), exc)
        finally:
            with self._lock:
                self._in_flight.discard(target.id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.submit_due()
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
        # Scrapes in flight end within their deadline: wait for them, so none writes after stop().
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()


def _reasons(bounded: BoundedScrape) -> str:
    return ", ".join(f"{reason}={n}" for reason, n in sorted(bounded.dropped.items()))
