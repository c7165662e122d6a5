"""requests: frontend_s, seconds from the HTTP arrival to the engine's arrival stamp

Revision ID: f2d8a4c6b310
Revises: f1a2b3c4d5e6
Create Date: 2026-12-04 11:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f2d8a4c6b310"
down_revision: str | Sequence[str] | None = "f1a2b3c4d5e6"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: rows stored before this revision did not measure the stage apart.
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("frontend_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_column("frontend_s")
