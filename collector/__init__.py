"""kvpilot collector: the system of record for engine telemetry and scraped metrics."""
