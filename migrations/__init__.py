"""Alembic migrations for collector.schema (the only way the schema changes; docs/architecture.md)."""
