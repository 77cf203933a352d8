"""Runs and responses record the server process that executes them (``owner``).

Several server processes may share one database: at start a process marks unfinished only the
rows whose owner is gone, not those another live process is still generating.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("runs", "responses"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("owner", sa.String(64), nullable=True))


def downgrade() -> None:
    for table in ("runs", "responses"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("owner")
