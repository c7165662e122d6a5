"""Serve the alerts API for `kvpilot alerts run`, demos and tests: uvicorn in a daemon thread
(plumbing.serving), after the bind check.

Port 0 picks a free port; `.url` says which. As every kvpilot service (docs/architecture.md, "Trust
boundaries"), the API binds loopback unless told otherwise and refuses any other address without a token
(`check_api_bind`).
"""

from __future__ import annotations

from typing import Any

from plumbing.bind import check_bind
from plumbing.serving import ThreadServer, serve_in_thread


def check_api_bind(host: str, token: str | None) -> None:
    """Refuse (UnsafeBindError) a non-loopback address without a token, as the collector does."""
    check_bind(
        host,
        has_credential=bool(token),
        service="the alerts API",
        missing="a token: set KVPILOT_ALERTS_API_TOKEN (or --api-token) or bind to 127.0.0.1",
    )


def serve_api(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> ThreadServer:
    """Serve the alerts API (alerts.api.create_api_app); refuses an unsafe bind before listening."""
    state = getattr(getattr(app, "state", None), "alerts", None)
    check_api_bind(host, getattr(state, "token", None))
    return serve_in_thread(app, host=host, port=port, name="kvpilot-alerts-api", timeout_s=10.0)
