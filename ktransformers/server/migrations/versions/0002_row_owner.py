"""Runs and responses record the server process that executes them (``owner``); a response records
a cancel asked through another server (``cancel_requested``).

Several server processes may share one database: at start a process marks unfinished only the
rows whose owner is gone, not those another live process is still generating; the owner of a
background response reads ``cancel_requested`` at each save and stops.

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
            if table == "responses":
                batch.add_column(sa.Column("cancel_requested", sa.Boolean(), nullable=False,
                                           server_default=sa.false()))


def downgrade() -> None:
    for table in ("runs", "responses"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("owner")
            if table == "responses":
                batch.drop_column("cancel_requested")
