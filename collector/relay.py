"""A node relay: the engines of one node push to it over loopback; it forwards their pushes as bundles.

An engine flushes about once a second; a thousand engines are a thousand requests a second at the
collectors, each paying HTTP, authentication and a turn at the storage stage before its first event
(`collector.bundle` says why that is the fleet's bottleneck). The relay runs on each node (`kvpilot
collector relay`), speaks the collector's own push API to the node's engines (POST /v1/ingest, /health:
an engine's sink is pointed at it and changes nothing else), and every `flush_interval_s` forwards what
arrived as one bundle to POST /v1/ingest/bundle.

It keeps no state and acknowledges nothing itself: an engine's request is held until the collector
answered its member, and gets that answer (202, a duplicate's 200, the member's own refusal). When the
collector cannot be reached or is overloaded, every held push is answered 503 (or the collector's 429)
with Retry-After, and each engine's sink spools and retries its own batch under its own key. So the
relay adds no place where an acknowledged event can be lost, and a retried push is still stored once.

Bounds: a push's body (`max_member_bytes`, 413) and what the held pushes may hold together
(`max_pending_bytes`, 429 with Retry-After); a bundle holds at most `max_members` and `max_bundle_bytes`.
Pushes need the relay's ingest token (the one it forwards with). Counted in /metrics
(`kvpilot_relay_*`); upstream failures are logged at most once every 10 s per kind.
"""

from __future__ import annotations

import asyncio
import gzip
import hmac
import logging
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from collector import bundle

log = logging.getLogger("kvpilot.relay")

BODY_TIMEOUT_S = 10.0  # a push trickling its body must not hold the relay's memory for ever
UPSTREAM_FAILED = {"detail": "the collector could not be reached through the relay; retry later"}


@dataclass(frozen=True)
class RelayConfig:
    upstream: str  # the collector's base URL
    token: str | None  # the ingest token: pushes must present it, bundles are sent with it
    flush_interval_s: float = 0.2
    max_members: int = 64  # within the collector's `ingest_group_max_batches` (256 by default), its bound
    max_bundle_bytes: int = 16 * 2**20  # the collector's default `max_batch_bytes`
    max_member_bytes: int = 16 * 2**20
    max_pending_bytes: int = 128 * 2**20
    upstream_timeout_s: float = 10.0
    gzip_level: int = 1  # 0: bundles go uncompressed

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http(s) URL, got {self.upstream!r}")
        if self.flush_interval_s <= 0 or self.max_members < 1 or not 0 <= self.gzip_level <= 9:
            raise ValueError("flush_interval_s must be > 0, max_members >= 1, gzip_level 0-9")
        if self.max_member_bytes > self.max_bundle_bytes:
            raise ValueError("max_member_bytes must not exceed max_bundle_bytes")


@dataclass
class _Held:
    member: bundle.Member
    answer: asyncio.Future[tuple[int, dict[str, Any], dict[str, str]]] = field(repr=False)


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.members = Counter(
            "kvpilot_relay_members", "pushes answered, by the status they got", ["status"], registry=registry
        )
        self.bundles = Counter("kvpilot_relay_bundles", "bundles sent, by outcome", ["outcome"], registry=registry)
        self.refused = Counter(
            "kvpilot_relay_refused", "pushes refused by the relay itself, by reason", ["reason"], registry=registry
        )
        self.upstream_seconds = Histogram(
            "kvpilot_relay_upstream_seconds",
            "a bundle's round trip to the collector",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )
        self.bundle_members = Histogram(
            "kvpilot_relay_bundle_members", "pushes per bundle", buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry
        )


class Forwarder:
    """The held pushes and their bundles: the first push after a flush starts the next one's clock; a bundle
    that is full goes at once. Bundles are sent concurrently (each its own request)."""

    def __init__(self, config: RelayConfig, client: httpx.AsyncClient, metrics: RelayMetrics) -> None:
        self.config, self.client, self.metrics = config, client, metrics
        self.pending: list[_Held] = []
        self.pending_bytes = 0
        self.held_bytes = 0  # of every push not yet answered, pending or in flight
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._last_log: dict[str, float] = {}

    async def submit(self, member: bundle.Member) -> tuple[int, dict[str, Any], dict[str, str]]:
        """The collector's answer to `member` (status, JSON body, headers)."""
        size = len(member.body)
        if self.held_bytes + size > self.config.max_pending_bytes:
            self.metrics.refused.labels("overloaded_bytes").inc()
            self.log_limited("refused-overloaded_bytes", "pushes refused with 429: the relay holds its byte bound")
            limit = self.config.max_pending_bytes
            detail = f"{self.held_bytes} bytes of pushes held by the relay, the limit is {limit}; retry later"
            return 429, {"detail": detail}, {"Retry-After": "1"}
        held = _Held(member, asyncio.get_running_loop().create_future())
        if self.pending_bytes + size > self.config.max_bundle_bytes:
            self._flush()
        self.pending.append(held)
        self.pending_bytes += size
        self.held_bytes += size
        try:
            if len(self.pending) >= self.config.max_members:
                self._flush()
            elif self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self.config.flush_interval_s, self._flush)
            return await asyncio.shield(held.answer)
        finally:
            self.held_bytes -= size

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.pending:
            return
        held, self.pending, self.pending_bytes = self.pending, [], 0
        task = asyncio.ensure_future(self._send(held))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, held: list[_Held]) -> None:
        self.metrics.bundle_members.observe(len(held))
        body = bundle.encode([h.member for h in held])
        headers = {"Content-Type": bundle.MEDIA_TYPE}
        if self.config.token is not None:
            headers["Authorization"] = f"Bearer {self.config.token}"
        if self.config.gzip_level:
            body = gzip.compress(body, compresslevel=self.config.gzip_level)
            headers["Content-Encoding"] = "gzip"
        started = time.perf_counter()
        try:
            resp = await self.client.post(self.config.upstream.rstrip("/") + bundle.PATH, content=body, headers=headers)
            answers = self._answers(resp, len(held))
        except httpx.HTTPError as exc:
            self.log_limited(
                "unreachable", f"collector unreachable ({type(exc).__name__}); {len(held)} pushes told to retry"
            )
            self.metrics.bundles.labels("unreachable").inc()
            answers = [(503, UPSTREAM_FAILED, {"Retry-After": "1"})] * len(held)
        except Exception as exc:  # whatever went wrong, every held push gets an answer
            log.exception("relaying a bundle of %d pushes failed", len(held))
            self.metrics.bundles.labels("failed").inc()
            detail = {"detail": f"the relay failed to forward the push ({type(exc).__name__}); retry later"}
            answers = [(502, detail, {"Retry-After": "1"})] * len(held)
        finally:
            self.metrics.upstream_seconds.observe(time.perf_counter() - started)
        for h, answer in zip(held, answers, strict=True):
            self.metrics.members.labels(str(answer[0])).inc()
            if not h.answer.done():
                h.answer.set_result(answer)

    def _answers(self, resp: httpx.Response, n: int) -> list[tuple[int, dict[str, Any], dict[str, str]]]:
        """Each member's answer from the collector's; its body is passed on only when it is the members'
        results (a refusal of the whole bundle is not a push's own and is not echoed)."""
        retry = {"Retry-After": resp.headers.get("Retry-After", "1")}
        if resp.status_code in (429, 503):
            self.metrics.bundles.labels(f"refused_{resp.status_code}").inc()
            self.log_limited("busy", f"collector answered {resp.status_code}; {n} pushes told to retry")
            return [(resp.status_code, {"detail": "the collector is overloaded; retry later"}, retry)] * n
        results = None
        if resp.status_code == 200:
            try:
                results = [(int(r["status"]), r) for r in resp.json()["results"]]
            except (ValueError, KeyError, TypeError):
                results = None
        if results is None or len(results) != n:
            self.metrics.bundles.labels(f"refused_{resp.status_code}").inc()
            self.log_limited("refused", f"collector refused a bundle of {n} pushes with {resp.status_code}")
            return [(502, {"detail": f"the collector refused the relay's bundle ({resp.status_code})"}, retry)] * n
        self.metrics.bundles.labels("stored").inc()
        out = []
        for status, r in results:
            body = {k: v for k, v in r.items() if v is not None and k not in ("status", "key")}
            out.append((status, body, retry if status in (429, 503) else {}))
        return out

    def log_limited(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, -1e9) >= 10.0:
            self._last_log[kind] = now
            log.warning("%s", message)

    async def close(self) -> None:
        self._flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)


router = APIRouter()


@router.post("/v1/ingest")
async def ingest(request: Request) -> Response:
    relay: Relay = request.app.state.relay
    refusal = relay.check(request)
    if refusal is not None:
        return refusal
    key = request.headers.get("idempotency-key")
    if key is not None and not bundle.KEY_PATTERN.fullmatch(key):
        return relay.refuse(422, "invalid_request", "Idempotency-Key: 1-200 printable ASCII characters")
    limit = relay.config.max_member_bytes
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    return relay.refuse(413, "too_large", f"body exceeds the limit of {limit} bytes")
    except TimeoutError:
        return relay.refuse(408, "body_timeout", f"the body did not arrive within {BODY_TIMEOUT_S:g}s")
    raw = bytes(body)
    if request.headers.get("content-encoding", "identity").strip().lower() == "gzip":
        try:
            inflated = _gunzip(raw, limit)
        except (zlib.error, ValueError):
            return relay.refuse(400, "bad_gzip", "body is not valid gzip")
        if inflated is None:
            return relay.refuse(413, "too_large", f"decompressed body exceeds the limit of {limit} bytes")
        raw = inflated
    status, payload, headers = await relay.forwarder.submit(bundle.Member(key, raw))
    return JSONResponse(payload, status_code=status, headers=headers)


def _gunzip(data: bytes, limit: int) -> bytes | None:
    """One gzip member inflated, None past `limit` bytes (a zip bomb stops there); ValueError when invalid."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = inflater.decompress(data, limit + 1)
    if len(out) > limit:
        return None
    if not inflater.eof or inflater.unused_data:
        raise ValueError("truncated gzip, or data after it")
    return out


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    relay: Relay = request.app.state.relay
    return {"status": "ok", "upstream": relay.config.upstream, "held_bytes": relay.forwarder.held_bytes}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.relay.registry), media_type=CONTENT_TYPE_LATEST)


class Relay:
    def __init__(self, config: RelayConfig, registry: CollectorRegistry) -> None:
        self.config, self.registry = config, registry
        self.metrics = RelayMetrics(registry)
        self.client = httpx.AsyncClient(timeout=config.upstream_timeout_s)
        self.forwarder = Forwarder(config, self.client, self.metrics)
        Gauge("kvpilot_relay_held_bytes", "body bytes of pushes not yet answered", registry=registry).set_function(
            lambda: self.forwarder.held_bytes
        )

    def check(self, request: Request) -> Response | None:
        """The token and the media type of a push; a refusal to send, or None."""
        if self.config.token is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given:
                return self.refuse(401, "unauthorized", "missing bearer token", {"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(given.encode(), self.config.token.encode()):
                return self.refuse(403, "forbidden", "wrong bearer token for pushes")
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype != "application/json":
            return self.refuse(415, "unsupported_media", f"content-type must be application/json, got {ctype!r}")
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", "", "gzip"):
            detail = f"content-encoding must be gzip or identity, got {encoding!r}"
            return self.refuse(415, "unsupported_encoding", detail)
        return None

    def refuse(self, status: int, reason: str, detail: str, headers: dict[str, str] | None = None) -> Response:
        """A push the relay refuses itself: counted, logged (at most once per reason every 10 s), answered."""
        self.metrics.refused.labels(reason).inc()
        self.forwarder.log_limited(f"refused-{reason}", f"push refused with {status} {reason}: {detail}")
        return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def create_app(config: RelayConfig, registry: CollectorRegistry | None = None) -> FastAPI:
    relay = Relay(config, registry or CollectorRegistry())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await relay.forwarder.close()
            await relay.client.aclose()

    app = FastAPI(title="kvpilot relay", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.relay = relay
    app.include_router(router)
    return app
