"""instance_owners: who first claimed each instance name (a push identity or a scrape target)

Revision ID: a3c8e5f1d7b2
Revises: b5f2a9d03c41
Create Date: 2026-12-04 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a3c8e5f1d7b2"
down_revision: str | Sequence[str] | None = "b5f2a9d03c41"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A new table only. Existing scrape targets keep their instances (the oldest target of each);
    # pushed instances stay unclaimed until their next push, whose identity then owns them.
    op.create_table(
        "instance_owners",
        sa.Column("instance", sa.String(length=200), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("claimed_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("instance", name=op.f("pk_instance_owners")),
    )
    op.create_index(op.f("ix_instance_owners_owner"), "instance_owners", ["owner"], unique=False)
    op.execute(
        "INSERT INTO instance_owners (instance, owner, claimed_at)"
        " SELECT instance, 'target:' || CAST(MIN(id) AS VARCHAR(20)), MIN(created_at)"
        " FROM scrape_targets GROUP BY instance"
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_instance_owners_owner"), table_name="instance_owners")
    op.drop_table("instance_owners")
