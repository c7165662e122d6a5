"""The collector's own exceptions: database errors are translated into these at one boundary."""

from __future__ import annotations


class CollectorError(Exception):
    """Base of every error the collector raises on purpose."""


class SchemaOutdatedError(CollectorError):
    """The database is not migrated to the code's Alembic head; the message names the fix."""


class StorageError(CollectorError):
    """The database refused or failed an operation (connection lost, disk full, lock timeout...)."""


class StorageUnavailableError(StorageError):
    """The database cannot be reached right now; the request may be retried."""


class IdempotencyConflictError(CollectorError):
    """An idempotency key was reused for a batch with different content."""
