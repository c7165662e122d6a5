"""Plumbing every kvpilot package shares, written once: one idea per module, none of the project imported.

- `percentile`: the one percentile definition (nearest rank) behind every figure computed in Python.
- `lengths`: clipping a request's prompt and output to a context limit.
- `process`: a child process started, waited on until its health endpoint answers, and stopped.
- `serving`: an ASGI app served by uvicorn in a thread of this process.
- `bind`: whether a listen address is loopback (a non-loopback bind needs a credential).
- `body_limit`: ASGI middleware answering 413 before anything parses an oversized body.
- `openloop`: the open loop every load sender shares: each request started at its offset, its lateness recorded.

Any package may import these modules; they import only the standard library and third-party packages, so
importing them never pulls in a part of kvpilot.
"""
