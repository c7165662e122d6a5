"""sample_rollups (per instance, run and minute, the engine samples' KV gauges: sums and counts)

Revision ID: d5f7b9c1e3a4
Revises: c4e6a8b0d2f3
Create Date: 2026-12-07 02:30:00.000000

Kept by ingest on both dialects, as `step_rollups` and `alloc_rollups` are (`collector.rollup`); a database
upgraded to this revision has no watermark for it, so the collector's maintenance computes its minutes from the
raw samples still kept (a day a transaction) on its first rounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "d5f7b9c1e3a4"
down_revision: str | Sequence[str] | None = "c4e6a8b0d2f3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sample_rollups",
        sa.Column("instance", sa.String(length=200), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("bucket_ts", sa.Float(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("kv_usage_sum", sa.Float(), nullable=False),
        sa.Column("kv_usage_n", sa.BigInteger(), nullable=False),
        sa.Column("cold_usage_sum", sa.Float(), nullable=False),
        sa.Column("cold_usage_n", sa.BigInteger(), nullable=False),
        sa.Column("fragmentation_sum", sa.Float(), nullable=False),
        sa.Column("fragmentation_n", sa.BigInteger(), nullable=False),
        sa.Column("internal_waste_sum", sa.Float(), nullable=False),
        sa.Column("internal_waste_n", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("instance", "run_id", "bucket_ts", name=op.f("pk_sample_rollups")),
    )
    with op.batch_alter_table("sample_rollups", schema=None) as batch_op:
        batch_op.create_index("ix_sample_rollups_bucket_ts", ["bucket_ts"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sample_rollups", schema=None) as batch_op:
        batch_op.drop_index("ix_sample_rollups_bucket_ts")
    op.drop_table("sample_rollups")
    op.execute("DELETE FROM rollup_watermarks WHERE name = 'samples'")
