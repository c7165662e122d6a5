"""A local webhook receiver that logs what arrived: for `kvpilot demo`, `kvpilot alerts run --sink-port`,
the benchmark and the tests. It verifies the HMAC signature when given the secret and answers 2xx once per
Idempotency-Key (a duplicate is acknowledged and counted, not stored twice).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Received:
    at: float
    idempotency_key: str
    payload: Any
    signature_ok: bool | None
    body: bytes = b""  # the bytes as they arrived, for comparing senders byte for byte


@dataclass
class WebhookSink:
    server: ThreadingHTTPServer
    thread: threading.Thread
    secret: str | None = None
    received: list[Received] = field(default_factory=list)
    duplicates: int = 0
    status_code: int = 200
    delay_s: float = 0.0  # a slow receiver: wait this long before answering
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)

    @property
    def url(self) -> str:
        host, port = self.server.socket.getsockname()[:2]  # server_address, typed without its family
        return f"http://{host}:{port}/"

    def wait_for(self, count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while len(self.received) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.arrived.wait(left)
            return True

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def run_webhook_sink(
    host: str = "127.0.0.1", port: int = 0, *, secret: str | None = None, log_payloads: bool = True
) -> WebhookSink:
    """Start the sink in a daemon thread; port 0 picks a free one (see `.url`)."""
    holder: dict[str, WebhookSink] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return None

        def do_POST(self) -> None:
            sink = holder["sink"]
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if sink.delay_s > 0:
                time.sleep(sink.delay_s)
            if sink.status_code >= 300:
                self.send_response(sink.status_code)
                self.end_headers()
                return
            try:
                payload = json.loads(body)
            except ValueError:
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b"body is not JSON")
                return
            signature_ok = None
            if sink.secret is not None:
                expected = "sha256=" + hmac.new(sink.secret.encode(), body, hashlib.sha256).hexdigest()
                signature_ok = hmac.compare_digest(expected, self.headers.get("X-Kvpilot-Signature", ""))
                if not signature_ok:
                    log.warning("webhook sink: bad signature, rejected")
                    self.send_response(401)
                    self.end_headers()
                    return
            key = self.headers.get("Idempotency-Key", "")
            with sink.arrived:
                if key and any(r.idempotency_key == key for r in sink.received):
                    sink.duplicates += 1
                else:
                    sink.received.append(Received(time.time(), key, payload, signature_ok, body))
                    if log_payloads:
                        status = payload.get("status") if isinstance(payload, dict) else "alerts"
                        names = sorted(
                            {
                                a.get("labels", {}).get("alertname", "?")
                                for a in (payload.get("alerts", []) if isinstance(payload, dict) else payload)
                            }
                        )
                        log.warning("webhook sink: %s %s %s", status, ",".join(names), key)
                sink.arrived.notify_all()
            self.send_response(200)
            self.end_headers()

    server = ThreadingHTTPServer((host, port), Handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="kvpilot-webhook-sink", daemon=True
    )
    sink = WebhookSink(server, thread, secret)
    holder["sink"] = sink
    thread.start()
    return sink
