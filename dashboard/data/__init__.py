"""Every read the dashboard makes, one module per concern, all through the other packages' own functions.

- `base`: the filters, the engine, schema checks and `DataUnavailable`.
- `catalog`: instances (pushed and scraped, with their target labels), runs, scrape targets.
- `serving`: the overview's headline numbers, per-instance table and gauge charts.
- `scraped`: what a scrape gives per label set: engine and GPU gauges, counter rates, histogram percentiles.
- `latency`, `kv`: figures from per-request, step, sample and allocation events.
- `load`: KV usage, requests running and waiting from every step where steps are stored (else sampled), with
  their sources.
- `alerting`, `tuning`: alert state, deliveries and silences (alerts package); proposals (tuner.proposals)
  and Optuna studies.

Pages call each function through its module (`from dashboard.data import latency; latency.summary(f)`),
so tests monkeypatch that module's attribute. Results are DataFrames with display-ready
column names, cached by their arguments for `TTL_S`. No SQL here: the collector's read package, the
alerts package and the tuner own it (docs/architecture.md). The only writes are proposal status and silences, and
they take the signed-in user (dashboard.auth) they are made by.

What is shown is real traffic: the tuner's simulated and trial runs are told apart by one rule,
`catalog.is_simulated`, and left out unless the sidebar asks for them (`Filters.hidden`).
"""

from dashboard.data.base import DataUnavailable, Filters

__all__ = ["DataUnavailable", "Filters"]
