"""Prometheus-style alerting over kvpilot's stored canonical series, with an Alertmanager-compatible notifier.

Layers, each in its own module: `durations` and `expr_*` (the expression language), `rules` (rule files),
`state` (the pending/firing/resolved machine), `matchers` (label matchers of routes, silences
and selectors), `templates`, `alertmanager` (payload v4 and fingerprints),
`dispatch` (grouping, silences), `store` (SQL: state, lease, outbox), `delivery` (the outbox worker),
`runner` (the evaluator loop), `api` + `api_server` (the Alertmanager API v2 subset: silences, alerts,
/metrics), `sql_source` (series from the collector's tables), `sink` (a local logging webhook receiver),
`promtest` (`kvpilot alerts test`), `promql_export` (`kvpilot alerts export-prometheus`).
"""
