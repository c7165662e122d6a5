"""Third-party serving engines as kvpilot sources and tuning targets, one subpackage per engine.

An integration knows its engine's processes, command line, logs, spans and HTTP API; it imports nothing of
kvpilot but the engine's wire schema and workload types (`engine`), so the collector, the tuner and the CLI
can all build on it (docs/architecture.md, "Who may import whom").
"""
