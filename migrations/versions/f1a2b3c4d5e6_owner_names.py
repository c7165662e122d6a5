"""instance owners by identity name: instances pushed without a token belong to the identity `ingest`

Revision ID: f1a2b3c4d5e6
Revises: 35c582cf7d65
Create Date: 2026-12-06 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "f1a2b3c4d5e6"
down_revision: str | Sequence[str] | None = "35c582cf7d65"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Data only. Owners are identity names now (collector.identities). `anonymous` (pushes to a collector
    # without a token) becomes `ingest`, the identity of KVPILOT_INGEST_TOKEN, so setting a token keeps
    # those instances. `token:<fingerprint>` owners cannot be named here (the database never saw a
    # secret): the collector adopts them at startup for every secret it knows (collector.owners.adopt).
    op.execute("UPDATE instance_owners SET owner = 'ingest' WHERE owner = 'anonymous'")


def downgrade() -> None:
    # The older code knows only fingerprints: it re-claims a pushed instance for whoever pushes it next.
    op.execute("DELETE FROM instance_owners WHERE owner NOT LIKE 'target:%'")
