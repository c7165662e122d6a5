"""Serve an ASGI app (the alerts API) with uvicorn in a daemon thread: for `kvpilot alerts run`, demos, tests.

Port 0 picks a free port; `.url` says which. `stop()` asks uvicorn to exit and joins the thread.
As every kvpilot service (docs/architecture.md, "Trust boundaries"), the API binds loopback unless told otherwise and
refuses any other address without a token (`check_api_bind`).
"""

from __future__ import annotations

import ipaddress
import threading
import time
from typing import Any

import uvicorn


class UnsafeBindError(ValueError):
    """The API was asked to listen beyond loopback without a bearer token."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname other than localhost, or "" (every address): not provably loopback


def check_api_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback address without a token, as the collector does."""
    if not token and not is_loopback(host):
        raise UnsafeBindError(
            f"refusing to serve the alerts API on {host or 'every address'!r} without a token: set "
            "KVPILOT_ALERTS_API_TOKEN (or --api-token) or bind to 127.0.0.1"
        )


class ApiServer:
    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 10.0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kvpilot-alerts-api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"alerts API did not start on {host}:{port} (port in use?)")
            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.host, self.port = sock.getsockname()[:2]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def serve_api(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> ApiServer:
    """Serve the alerts API (alerts.api.create_api_app); refuses an unsafe bind before listening."""
    state = getattr(getattr(app, "state", None), "alerts", None)
    check_api_bind(host, getattr(state, "token", None))
    return ApiServer(app, host=host, port=port)
