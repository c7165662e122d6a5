"""latency_sketches (per minute and request stage, a fleet's request latencies in logarithmic bins) and
alloc_rollups (per instance, run and minute, the KV allocation records by op and tier)

Revision ID: b8d2f4a6c9e1
Revises: a7c3e9f1b2d4
Create Date: 2026-12-06 03:30:00.000000

The sketch is rolled by the collector's maintenance on PostgreSQL (`collector.latency_rollup`), created on
both dialects so the schema is one (SQLite's reads stay on the raw rows); the allocation rollup is kept by
ingest on both, as `step_rollups` is (`collector.rollup`).
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

    op.create_table(
        "alloc_rollups",
        sa.Column("instance", sa.String(length=200), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("bucket_ts", sa.Float(), nullable=False),
        sa.Column("op", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=8), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("blocks", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("instance", "run_id", "bucket_ts", "op", "tier", name=op.f("pk_alloc_rollups")),
    )
    with op.batch_alter_table("alloc_rollups", schema=None) as batch_op:
        batch_op.create_index("ix_alloc_rollups_bucket_ts", ["bucket_ts"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("alloc_rollups", schema=None) as batch_op:
        batch_op.drop_index("ix_alloc_rollups_bucket_ts")
    op.drop_table("alloc_rollups")
    op.drop_table("latency_sketches")
