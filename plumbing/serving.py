"""An ASGI app served by uvicorn in a daemon thread of this process: the alerts API, a collector for the demo
and tests, the demo's engine.

`serve_in_thread` binds the socket itself, so a busy port is an immediate, clear error and port 0 picks a
free one that `.url` then names; it returns once uvicorn serves (lifespan startup done), or raises
`ServeError`. `stop()` asks uvicorn to exit and joins the thread.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn


class ServeError(RuntimeError):
    """The server could not listen, or did not start serving in time (its startup failed: see its log)."""


@dataclass
class ThreadServer:
    """A uvicorn server running in `thread`, listening on `host:port`."""

    host: str
    port: int
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> ThreadServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _listen(host: str, port: int) -> socket.socket:
    bare = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bare, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host or 'every address'}:{port}: {exc.strerror or exc}") from None
    return sock


def _run(server: uvicorn.Server, sock: socket.socket) -> None:
    # uvicorn logs why its startup failed, then exits; serve_in_thread raises ServeError for it
    with contextlib.suppress(SystemExit):
        server.run(sockets=[sock])


def serve_in_thread(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    name: str = "kvpilot-server",
    log_level: str = "warning",
    lifespan: Literal["auto", "on", "off"] = "on",
    timeout_s: float = 30.0,
) -> ThreadServer:
    """Serve `app` on `host:port` (0: a free port) in a daemon thread called `name`; returns once it serves."""
    sock = _listen(host, port)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan=lifespan)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=_run, args=(server, sock), name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout_s)
            sock.close()
            raise ServeError(f"{name} did not start serving on {host or 'every address'}:{port} (see its log)")
        time.sleep(0.01)
    bound_host, bound_port = sock.getsockname()[:2]
    return ThreadServer(host=bound_host, port=bound_port, server=server, thread=thread)
