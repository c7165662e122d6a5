"""`kvpilot bench ingest --abuse`: small bodies crafted to cost the collector gigabytes, replayed one by one.

Each case runs against a fresh collector (`python -m collector serve`, its own process, SQLite), as an
attacker holding the ingest token (every engine has it) or a hostile scraped endpoint would. Meanwhile
/health is polled every 50 ms from a thread of its own, and an honest sender pushes small valid batches
the sink's way (same Idempotency-Key until acknowledged): what it was acknowledged must be stored.

Cases: what once amplified, and what the fixes' own walk found (`nested_value`, `empty_attributes`):
- /v1/ingest, gzip: 10,000 events x 100 unknown keys; 99,999 `{"type":"request"}`; 3M `{}` events; one
  event holding an 11M-element array;
- /v1/traces, gzip: 16M empty protobuf spans; one span of 8M empty attributes; 3M `{}` OTLP/JSON spans;
- scrape targets: a 1 GiB page gzipped twice (`Content-Encoding: gzip, gzip`), the same gzipped once,
  and a plain page of 1M samples (16 MB).
Figures per case: `wire_bytes`, `answer` (status and detail, or `up=0` and `last_error`), `seconds` (to
the answer), `peak_rss_mb` (the collector's VmHWM: its high-water mark, start-up included), `rss_after_mb`,
`health_max_s`, `honest_acked` and `lost`. Targets: every case answered 4xx or failed `up=0` with its
reason, peak RSS < 512 MB, /health within 0.5 s, nothing acknowledged lost.
"""

from __future__ import annotations

import gzip
import http.server
import json
import os
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

from benchmarks.ingest import make_events
from benchmarks.ingest_overload import TOKEN, _collector, _lost, probe_health

ADMIN = "bench-abuse-admin"
TARGETS = {"peak_rss_mb": 512, "health_max_s": 0.5, "lost": 0}
POLL_S = 0.05
HONEST_EVENTS = 100


def _ld(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    size, varint = len(payload), bytearray()
    while True:
        varint.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            return bytes([number << 3 | 2]) + bytes(varint) + payload


def _one_scope(spans: bytes) -> bytes:
    """ExportTraceServiceRequest{resource_spans{scope_spans{<spans>}}}."""
    return _ld(1, _ld(2, spans))


def _gzip_stream(size: int, layers: int = 1) -> bytes:
    """`size` bytes of comment lines (a valid exposition), gzipped `layers` times, built a MiB at a time."""
    line = b"#" * ((1 << 20) - 1) + b"\n"
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    data = b"".join([*(packer.compress(line) for _ in range(size // len(line))), packer.flush()])
    for _ in range(layers - 1):
        data = gzip.compress(data, 9)
    return data


@dataclass(frozen=True)
class Push:
    name: str
    path: str
    content_type: str
    build: Callable[[], bytes]  # the inflated body; sent gzipped


@dataclass(frozen=True)
class Page:
    name: str
    coding: str | None
    build: Callable[[], bytes]  # the body as served
    inflated: int | None = None  # its size once decoded, when compressed


def _cases(quick: bool) -> list[Push | Page]:
    bomb = (256 if quick else 1024) << 20
    return [
        Push(
            "ingest_unknown_keys",
            "/v1/ingest",
            "application/json",
            lambda: json.dumps({"events": [{"type": "request", **{f"k{j}": 0 for j in range(100)}}] * 10_000}).encode(),
        ),
        Push(
            "ingest_missing_fields",
            "/v1/ingest",
            "application/json",
            lambda: b'{"events":[' + b",".join([b'{"type":"request"}'] * 99_999) + b"]}",
        ),
        Push(
            "ingest_empty_events",
            "/v1/ingest",
            "application/json",
            lambda: b'{"events":[' + b"{}," * 3_000_000 + b"{}]}",
        ),
        Push(
            "ingest_nested_value",
            "/v1/ingest",
            "application/json",
            lambda: b'{"events":[{"type":"request","x":[' + b"0," * 11_000_000 + b"0]}]}",
        ),
        Push(
            "otlp_protobuf_empty_spans",
            "/v1/traces",
            "application/x-protobuf",
            lambda: _one_scope(_ld(2, b"") * 16_000_000),  # 32 MB: just under the inflated-body limit
        ),
        Push(
            "otlp_protobuf_empty_attributes",
            "/v1/traces",
            "application/x-protobuf",
            lambda: _one_scope(_ld(2, _ld(9, b"") * 8_000_000)),
        ),
        Push(
            "otlp_json_empty_spans",
            "/v1/traces",
            "application/json",
            lambda: b'{"resourceSpans":[{"scopeSpans":[{"spans":[' + b"{}," * 3_000_000 + b"{}]}]}]}",
        ),
        Page("scrape_stacked_gzip", "gzip, gzip", lambda: _gzip_stream(bomb, layers=2), bomb),
        Page("scrape_gzip_bomb", "gzip", lambda: _gzip_stream(bomb), bomb),
        Page("scrape_1m_samples", None, lambda: b"".join(b'm{i="%d"} 1\n' % i for i in range(1_000_000))),
    ]


# --- watching the collector ------------------------------------------------------------------------------


def _status_kb(pid: int, key: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class Watch:
    """/health latencies and an honest sender's acknowledged batches, while one case runs."""

    health_s: list[float] = field(default_factory=list)
    health_failures: int = 0
    acked: dict[str, int] = field(default_factory=dict)
    honest_refused: int = 0


def _watch(url: str, watch: Watch, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=10.0) as probe:
        while not stop.is_set():
            seconds, ok = probe_health(probe)
            watch.health_s.append(seconds)
            watch.health_failures += not ok
            stop.wait(POLL_S)


def _honest(url: str, watch: Watch, stop: threading.Event) -> None:
    """Small valid batches, retried under one key until acknowledged, as the engine's sink does."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=30.0) as client:
        n = 0
        while not stop.is_set():
            key = f"honest-{n}"
            body = json.dumps({"events": make_events(HONEST_EVENTS, n * HONEST_EVENTS)}).encode()
            while not stop.is_set():
                try:
                    resp = client.post("/v1/ingest", content=body, headers={"Idempotency-Key": key})
                except httpx.HTTPError:
                    stop.wait(0.2)
                    continue
                if resp.status_code in (200, 202):
                    watch.acked[key] = resp.json()["events"]
                    break
                watch.honest_refused += 1
                stop.wait(float(resp.headers.get("retry-after", "0.2")))
            n += 1
            stop.wait(0.2)


# --- hostile scrape target -------------------------------------------------------------------------------


class _Hostile(http.server.BaseHTTPRequestHandler):
    page: ClassVar[tuple[str | None, bytes]] = (None, b"")

    def do_GET(self) -> None:
        coding, body = self.page
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        if coding:
            self.send_header("Content-Encoding", coding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the collector gave up on it: what this case wants
            return

    def log_message(self, *args: object) -> None:
        return None


def _scrape_answer(url: str, page_url: str, timeout_s: float = 60.0) -> tuple[str, float]:
    """Register the hostile target and wait for its first scrape: (`up=...: last_error`, seconds)."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=url, headers=admin, timeout=10.0) as client:
        resp = client.post("/v1/targets", json={"url": page_url, "instance": "hostile", "interval_s": 3600})
        resp.raise_for_status()
        target_id = resp.json()["id"]
        started = time.perf_counter()
        while time.perf_counter() - started < timeout_s:
            answer = client.get(f"/v1/targets/{target_id}")
            if answer.status_code != 404:  # 404: the creation's commit is not visible yet
                answer.raise_for_status()
            target = answer.json()
            if target.get("last_scrape_at") is not None:
                up = "1" if target["up"] else "0"
                return f"up={up}: {target['last_error']}", time.perf_counter() - started
            time.sleep(POLL_S)
    return "no scrape result", timeout_s


def _push_answer(url: str, case: Push, wire: bytes) -> tuple[str, float]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": case.content_type, "Content-Encoding": "gzip"}
    started = time.perf_counter()
    try:
        resp = httpx.post(f"{url}{case.path}", content=wire, headers=headers, timeout=120.0)
    except httpx.HTTPError as exc:
        return f"no answer: {type(exc).__name__}", time.perf_counter() - started
    seconds = time.perf_counter() - started
    return f"{resp.status_code}: {_detail(resp)}", seconds


def _detail(resp: httpx.Response) -> str:
    if resp.headers.get("content-type", "").startswith("application/x-protobuf"):
        from google.rpc.status_pb2 import Status

        status = Status()
        status.ParseFromString(resp.content)
        return status.message
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    return str(body.get("detail") or body.get("message") or body)[:200] if isinstance(body, dict) else str(body)


def _run_case(root: Path, case: Push | Page) -> dict[str, Any]:
    body = case.build()
    server = None
    if isinstance(case, Page):
        wire = body
        _Hostile.page = (case.coding, body)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        overrides: dict[str, Any] = {
            "scrape_enabled": True,
            "scrape_allow_nets": ("127.0.0.0/8",),
            "admin_token": ADMIN,
        }
    else:
        wire = gzip.compress(body, 9)
        overrides = {}
    inflated = case.inflated if isinstance(case, Page) and case.inflated else len(body)
    del body
    db_url, proc = _collector(root, case.name, **overrides)
    watch, stop = Watch(), threading.Event()
    threads = [
        threading.Thread(target=fn, args=(proc.url, watch, stop), daemon=True, name=f"bench-{fn.__name__}")
        for fn in (_watch, _honest)
    ]
    for thread in threads:
        thread.start()
    try:
        if server is not None:
            answer, seconds = _scrape_answer(proc.url, f"http://127.0.0.1:{server.server_address[1]}/metrics")
        else:
            answer, seconds = _push_answer(proc.url, case, wire)
        time.sleep(1.0)  # what the collector still holds once it answered
        rss_after = _status_kb(proc.proc.pid, "VmRSS")
        peak = _status_kb(proc.proc.pid, "VmHWM")
    finally:
        stop.set()
        for thread in threads:
            thread.join(35)
        proc.stop()
        if server is not None:
            server.shutdown()
            server.server_close()
    return {
        "name": case.name,
        "wire_bytes": len(wire),
        "inflated_bytes": inflated,
        "answer": answer,
        "seconds": round(seconds, 3),
        "peak_rss_mb": round(peak, 1),
        "rss_after_mb": round(rss_after, 1),
        "health_max_s": round(max(watch.health_s, default=float("nan")), 3),
        "health_failures": watch.health_failures,
        "honest_acked": len(watch.acked),
        "honest_refused": watch.honest_refused,
        "lost": _lost(db_url, watch.acked),
    }


def _met(case: dict[str, Any]) -> bool:
    answered = case["answer"][:1] == "4" or (case["answer"].startswith("up=0: ") and "None" not in case["answer"])
    return (
        answered
        and case["peak_rss_mb"] < TARGETS["peak_rss_mb"]
        and case["health_max_s"] < TARGETS["health_max_s"]
        and case["health_failures"] == 0
        and case["lost"] == TARGETS["lost"]
    )


def run_abuse_bench(quick: bool = False) -> dict[str, Any]:
    """Every case against its own fresh collector; `quick` serves 256 MiB bombs instead of 1 GiB."""
    result: dict[str, Any] = {"quick": quick, "cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="kvpilot-bench-abuse-") as tmp:
        result["cases"] = [_run_case(Path(tmp), case) for case in _cases(quick)]
    result["load_average_at_end"] = os.getloadavg()
    result["targets"] = TARGETS
    for case in result["cases"]:
        case["met"] = _met(case)
    result["met"] = all(case["met"] for case in result["cases"])
    return result
