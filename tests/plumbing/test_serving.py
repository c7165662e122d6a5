"""An app served in a thread answers at `.url` until stopped; a busy port or a failing startup is a ServeError."""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI

from plumbing.serving import ServeError, serve_in_thread


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict:
        return {"ok": True}

    return app


def test_serves_on_a_free_port_until_stopped() -> None:
    server = serve_in_thread(_app(), name="test-server")
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    assert httpx.get(f"{server.url}/ping", timeout=5).json() == {"ok": True}
    server.stop()
    assert not server.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/ping", timeout=2)


def test_a_busy_port_is_a_clear_error() -> None:
    with serve_in_thread(_app()) as first, pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{first.port}"):
        serve_in_thread(_app(), port=first.port)


def test_a_failing_startup_is_a_serve_error() -> None:
    @asynccontextmanager
    async def broken(_app: FastAPI):
        raise RuntimeError("no database")
        yield

    with pytest.raises(ServeError, match="broken-app did not start serving"):
        serve_in_thread(FastAPI(lifespan=broken), name="broken-app", timeout_s=5.0)
