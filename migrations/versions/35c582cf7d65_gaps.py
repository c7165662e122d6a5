"""gaps: events a sink lost (type, reason, count, time span), from `gap` wire records

Revision ID: 35c582cf7d65
Revises: a3c8e5f1d7b2
Create Date: 2026-12-05 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "35c582cf7d65"
down_revision: str | Sequence[str] | None = "a3c8e5f1d7b2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A new table only: nothing stored before this revision recorded its losses.
    op.create_table(
        "gaps",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.BigInteger(), nullable=True),
        sa.Column("instance", sa.String(length=200), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("first_ts", sa.Float(), nullable=False),
        sa.Column("last_ts", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gaps")),
    )
    with op.batch_alter_table("gaps", schema=None) as batch_op:
        batch_op.create_index("ix_gaps_instance_ts", ["instance", "ts"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("gaps", schema=None) as batch_op:
        batch_op.drop_index("ix_gaps_instance_ts")
    op.drop_table("gaps")
