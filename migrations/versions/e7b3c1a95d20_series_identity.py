"""series identity: target labels and sample limit, label sets kept in downsampled history

Revision ID: e7b3c1a95d20
Revises: 6d5a1dec9ce9
Create Date: 2026-12-03 15:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e7b3c1a95d20"
down_revision: str | Sequence[str] | None = "6d5a1dec9ce9"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Existing targets get no static labels and the default limit; existing downsampled rows were
    # combined over label sets before this revision, so they read as the unlabelled series.
    with op.batch_alter_table("scrape_targets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("labels", sa.Text(), server_default=sa.text("'{}'"), nullable=False))
        batch_op.add_column(sa.Column("sample_limit", sa.Integer(), server_default=sa.text("10000"), nullable=False))
    with op.batch_alter_table("samples_downsampled", schema=None) as batch_op:
        batch_op.add_column(sa.Column("labels", sa.Text(), server_default=sa.text("'{}'"), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("samples_downsampled", schema=None) as batch_op:
        batch_op.drop_column("labels")
    with op.batch_alter_table("scrape_targets", schema=None) as batch_op:
        batch_op.drop_column("sample_limit")
        batch_op.drop_column("labels")
