"""requests: swap_s, seconds each request spent swapped out to the host tier

Revision ID: 6d5a1dec9ce9
Revises: d4a1e7c2b9f0
Create Date: 2026-12-02 14:59:51.382574
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "6d5a1dec9ce9"
down_revision: str | Sequence[str] | None = "d4a1e7c2b9f0"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NOT NULL with a server default: rows stored before this revision read 0 (nothing was measured).
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("swap_s", sa.Float(), server_default=sa.text("0"), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_column("swap_s")
