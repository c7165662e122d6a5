"""request_stage_minutes (per minute, a fleet's finished requests: their count and the sums of their stages)

Revision ID: c4e6a8b0d2f3
Revises: b8d2f4a6c9e1
Create Date: 2026-12-07 02:00:00.000000

Rolled by the collector's maintenance on PostgreSQL beside the latency sketch (`collector.latency_rollup`), under
its own watermark: a database upgraded to this revision has none, so the first rounds roll every minute whose
raw requests are still kept (a day's chunk a round), as the sketch's first rounds did. Created on both
dialects so the schema is one (SQLite's reads stay on the raw rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c4e6a8b0d2f3"
down_revision: str | Sequence[str] | None = "b8d2f4a6c9e1"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "request_stage_minutes",
        sa.Column("bucket_ts", sa.Float(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("queue_s", sa.Float(), nullable=False),
        sa.Column("prefill_s", sa.Float(), nullable=False),
        sa.Column("decode_s", sa.Float(), nullable=False),
        sa.Column("decode_excl_swap_s", sa.Float(), nullable=False),
        sa.Column("swap_s", sa.Float(), nullable=False),
        sa.Column("e2e_s", sa.Float(), nullable=False),
        sa.Column("frontend_s", sa.Float(), nullable=False),
        sa.Column("swaps", sa.BigInteger(), nullable=False),
        sa.Column("preemptions", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("bucket_ts", name=op.f("pk_request_stage_minutes")),
    )


def downgrade() -> None:
    op.drop_table("request_stage_minutes")
    op.execute("DELETE FROM rollup_watermarks WHERE name = 'stages'")
