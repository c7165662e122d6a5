"""latency_sketches: per minute and request stage, a fleet's request latencies in logarithmic bins

Revision ID: b8d2f4a6c9e1
Revises: a7c3e9f1b2d4
Create Date: 2026-12-06 03:30:00.000000

Rolled by the collector's maintenance on PostgreSQL (`collector.latency_rollup`); created on both dialects so
the schema is one (SQLite's reads stay on the raw rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b8d2f4a6c9e1"
down_revision: str | Sequence[str] | None = "a7c3e9f1b2d4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "latency_sketches",
        sa.Column("metric", sa.String(length=16), nullable=False),
        sa.Column("bucket_ts", sa.Float(), nullable=False),
        sa.Column("bin", sa.Integer(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("total", sa.Float(), nullable=False),
        sa.Column("peak", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("metric", "bucket_ts", "bin", name=op.f("pk_latency_sketches")),
    )


def downgrade() -> None:
    op.drop_table("latency_sketches")
