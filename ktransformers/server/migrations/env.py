"""Alembic's entry point: runs the revisions on the connection :func:`..db.migrate` hands over.

Only the server calls it (``Config.attributes["connection"]``), inside the transaction that holds
the migration lock, so every revision of one start commits or none does."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
