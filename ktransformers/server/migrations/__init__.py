"""Alembic revisions of the server's tables (``versions/``), applied by :class:`~..db.Database` at start."""
