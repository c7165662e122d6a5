"""Serve an ASGI app (the alerts API) with uvicorn in a daemon thread: for `kvpilot alerts run`, demos, tests.

Port 0 picks a free port; `.url` says which. `stop()` asks uvicorn to exit and joins the thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn


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
    return ApiServer(app, host=host, port=port)
