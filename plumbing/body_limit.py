"""A request body limit enforced before anything parses the body: 413 with the limit, never unbounded memory.

FastAPI reads and JSON-decodes the whole body before a handler (or pydantic's max_length) can look at it,
so a 64 MB prompt costs memory and event-loop time even when it is refused in the end. This ASGI
middleware answers 413 from the Content-Length header alone, and for a chunked body stops reading as
soon as the running total passes the limit. The engine and the alerts API mount it; the refusal names the field
(`{"detail": {"field": "body", "message": ...}}`) and `on_refused` lets a service count refusals.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int, on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        refused = False

        async def limited_receive() -> Message:
            # Past the limit: answer 413 now and tell the app the client left, so it stops reading;
            # whatever it answers after that is dropped (an exception here would be turned into a 400).
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, send: Send) -> None:
        if self.on_refused is not None:
            self.on_refused()
        body = json.dumps(
            {"detail": {"field": "body", "message": f"request body larger than {self.max_bytes} bytes"}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
