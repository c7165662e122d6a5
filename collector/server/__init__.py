"""`kvpilot collector serve`: the ingest API, target CRUD, /health and /metrics — this is the public surface.

- `app`: `create_app` (lifespan: database, schema check, health probe, scraper) and the one handler of
  refusals, which counts each in `kvpilot_collector_ingest_rejected_total{reason}` and logs it (rate-limited);
- `ingest_routes` (POST /v1/ingest), `otlp_routes` (POST /v1/traces: OTLP/HTTP spans, see `collector.otlp`),
  `target_routes` (/v1/targets), `health_routes` (/health, /metrics): module-level routers of thin handlers;
- `deps`: the state, session and the three scopes: ingest token (pushes), admin token (target
  administration), either (reading); `errors`: `Rejected`, the documented error shape, `RefusalLog`;
- `admission`: the bounds on pushes in flight (requests, bytes, time waiting for the database);
- `run`: `serve` (blocking) and `run_in_thread` (demo, tests: `handle = run_in_thread(settings)` ...
  `handle.stop()`, a plumbing.serving.ThreadServer); `process`: `start_subprocess(settings)` for a separate
  process that can be killed.
"""

from collector.server.app import create_app
from collector.server.process import CollectorProcess, start_subprocess
from collector.server.run import check_bind_safety, run_in_thread, serve

__all__ = [
    "CollectorProcess",
    "check_bind_safety",
    "create_app",
    "run_in_thread",
    "serve",
    "start_subprocess",
]
