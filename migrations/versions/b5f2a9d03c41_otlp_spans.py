"""otlp_spans: identities of the OTLP spans stored as request rows (a re-sent span is stored once)

Revision ID: b5f2a9d03c41
Revises: e7b3c1a95d20
Create Date: 2026-12-03 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b5f2a9d03c41"
down_revision: str | Sequence[str] | None = "e7b3c1a95d20"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A new table only: nothing existing changes, so this revision commutes with any other branch's.
    op.create_table(
        "otlp_spans",
        sa.Column("trace_id", sa.String(length=32), nullable=False),
        sa.Column("span_id", sa.String(length=16), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("trace_id", "span_id", name=op.f("pk_otlp_spans")),
    )
    op.create_index(op.f("ix_otlp_spans_received_at"), "otlp_spans", ["received_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_otlp_spans_received_at"), table_name="otlp_spans")
    op.drop_table("otlp_spans")
