"""The server's storage: SQLAlchemy models over SQLite in ``--data_dir``, or PostgreSQL with ``--database_url``.

SQLite (one file, the default) serves one server process; PostgreSQL is the store several server
processes share.  Either way the schema is versioned by Alembic (``migrations/``): a database
from an older version is migrated at start, one from a newer or unknown version is refused.

Every write is one transaction that also takes the row locks it needs (``lock=True``): on
PostgreSQL ``SELECT … FOR UPDATE``, on SQLite ``BEGIN IMMEDIATE`` (one writer at a time, across
processes too).  A write that was answered is committed.  Rows are ordered by an autoincrement
``seq``; the public ids (``asst_…``, ``thread_…``, ``msg_…``, ``run_…``) are separate unique columns.
Runs and responses record the process executing them (``owner``): a process starting later marks
unfinished only the rows of processes that are gone (each live process holds a PostgreSQL
advisory lock on its own id for as long as it runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import (JSON, Boolean, Float, Integer, String, Text, create_engine, event, select, text)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from ..errors import ConfigError
from .errors import APIError, UnknownCursor

DB_FILE = "ktransformers.sqlite3"
MIGRATIONS_DIR = Path(__file__).with_name("migrations")
#: the schemes --database_url accepts; all are served by psycopg 3
POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")
DATABASE_URL_FORM = "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE"
#: seconds a PostgreSQL connection attempt may take before start-up gives up
CONNECT_TIMEOUT_S = 10


class Base(DeclarativeBase):
    pass


class StoredObject:
    """The columns of every stored API object: its page order (``seq``), public id and creation time."""

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    created_at: Mapped[int] = mapped_column(Integer)


class Assistant(StoredObject, Base):
    __tablename__ = "assistants"
    name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    model: Mapped[str] = mapped_column(String(256))
    instructions: Mapped[str | None] = mapped_column(Text, nullable=True)
    tools: Mapped[list] = mapped_column(JSON, default=list)
    tool_resources: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    temperature: Mapped[float | None] = mapped_column(Float, nullable=True)
    top_p: Mapped[float | None] = mapped_column(Float, nullable=True)
    response_format: Mapped[Any] = mapped_column(JSON, nullable=True)

    def to_dict(self) -> dict:
        return {"id": self.id, "object": "assistant", "created_at": self.created_at, "name": self.name,
                "description": self.description, "model": self.model, "instructions": self.instructions,
                "tools": self.tools or [], "tool_resources": self.tool_resources or {},
                "metadata": self.meta or {}, "temperature": self.temperature, "top_p": self.top_p,
                "response_format": self.response_format or "auto"}


class Thread(StoredObject, Base):
    __tablename__ = "threads"
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    tool_resources: Mapped[dict | None] = mapped_column(JSON, nullable=True)

    def to_dict(self) -> dict:
        return {"id": self.id, "object": "thread", "created_at": self.created_at, "metadata": self.meta or {},
                "tool_resources": self.tool_resources or {}}


class Message(StoredObject, Base):
    __tablename__ = "messages"
    thread_id: Mapped[str] = mapped_column(String(64), index=True)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[list] = mapped_column(JSON, default=list)
    status: Mapped[str] = mapped_column(String(16), default="completed")
    assistant_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    attachments: Mapped[list] = mapped_column(JSON, default=list)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    completed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    incomplete_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    incomplete_details: Mapped[dict | None] = mapped_column(JSON, nullable=True)

    def text(self) -> str:
        out = []
        for part in self.content or []:
            if part.get("type") == "text":
                out.append((part.get("text") or {}).get("value", ""))
        return "\n".join(out)

    def to_dict(self) -> dict:
        return {"id": self.id, "object": "thread.message", "created_at": self.created_at,
                "thread_id": self.thread_id, "status": self.status, "incomplete_details": self.incomplete_details,
                "completed_at": self.completed_at, "incomplete_at": self.incomplete_at, "role": self.role,
                "content": self.content or [], "assistant_id": self.assistant_id, "run_id": self.run_id,
                "attachments": self.attachments or [], "metadata": self.meta or {}}


class Run(StoredObject, Base):
    __tablename__ = "runs"
    thread_id: Mapped[str] = mapped_column(String(64), index=True)
    assistant_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    model: Mapped[str] = mapped_column(String(256))
    instructions: Mapped[str | None] = mapped_column(Text, nullable=True)
    tools: Mapped[list] = mapped_column(JSON, default=list)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    temperature: Mapped[float | None] = mapped_column(Float, nullable=True)
    top_p: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    started_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cancelled_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    expires_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    usage: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    incomplete_details: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    message_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    tool_choice: Mapped[Any] = mapped_column(JSON, nullable=True)
    truncation_strategy: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    response_format: Mapped[Any] = mapped_column(JSON, nullable=True)
    parallel_tool_calls: Mapped[bool] = mapped_column(Boolean, default=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)  # Database.instance_id executing it

    def to_dict(self) -> dict:
        return {"id": self.id, "object": "thread.run", "created_at": self.created_at, "thread_id": self.thread_id,
                "assistant_id": self.assistant_id, "status": self.status, "required_action": None,
                "last_error": self.last_error, "expires_at": self.expires_at, "started_at": self.started_at,
                "cancelled_at": self.cancelled_at, "failed_at": self.failed_at, "completed_at": self.completed_at,
                "incomplete_details": self.incomplete_details, "model": self.model,
                "instructions": self.instructions or "", "tools": self.tools or [], "metadata": self.meta or {},
                "usage": self.usage, "temperature": self.temperature, "top_p": self.top_p,
                "max_prompt_tokens": self.max_prompt_tokens, "max_completion_tokens": self.max_completion_tokens,
                "truncation_strategy": self.truncation_strategy or {"type": "auto", "last_messages": None},
                "response_format": self.response_format or "auto", "tool_choice": self.tool_choice or "auto",
                "parallel_tool_calls": bool(self.parallel_tool_calls)}

    def step_dict(self) -> dict:
        """The run's one step (message creation), derived from the run."""
        status = {"queued": "in_progress", "cancelling": "in_progress", "incomplete": "completed",
                  "requires_action": "in_progress"}.get(self.status, self.status)
        return {"id": "step_" + self.id[4:], "object": "thread.run.step",
                "created_at": self.started_at or self.created_at,
                "run_id": self.id, "assistant_id": self.assistant_id, "thread_id": self.thread_id,
                "type": "message_creation", "status": status, "cancelled_at": self.cancelled_at,
                "completed_at": self.completed_at, "expired_at": None, "failed_at": self.failed_at,
                "last_error": self.last_error,
                "step_details": {"type": "message_creation", "message_creation": {"message_id": self.message_id}},
                "usage": self.usage, "metadata": {}}


ACTIVE_RUN = ("queued", "in_progress", "cancelling", "requires_action")


def private_file(path: Path) -> Path:
    """Create ``path`` readable by its owner only (0600), or make an existing file so: the
    conversations and logs stay private on a shared machine whatever the umask."""
    import os

    fd = os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path


def redact_url(url: str | URL) -> str:
    """``url`` with its password (in the user part or a ``?password=`` option) replaced by ``***``:
    what logs and errors may show."""
    url = make_url(url)
    if "password" in url.query:
        url = url.update_query_dict({"password": "***"})
    return url.render_as_string(hide_password=True)


def parse_database_url(raw: str) -> URL:
    """The SQLAlchemy URL of ``--database_url`` (PostgreSQL through psycopg 3), or one-line ConfigError.

    Text that does not parse is not echoed: where its password is cannot be told."""
    try:
        url = make_url(raw)
    except Exception:  # noqa: BLE001 - ArgumentError / ValueError on text that is not a URL
        raise ConfigError(f"--database_url: not a database URL (expected {DATABASE_URL_FORM})") from None
    shown = redact_url(url)
    if url.drivername not in POSTGRES_SCHEMES:
        raise ConfigError(f"--database_url {shown}: the scheme '{url.drivername}' is not served (expected "
                          f"{DATABASE_URL_FORM}; leave the flag out for SQLite in --data_dir)")
    if not url.database:
        raise ConfigError(f"--database_url {shown}: names no database (expected {DATABASE_URL_FORM})")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise ConfigError(f"--database_url {shown}: PostgreSQL needs the psycopg driver: "
                          "pip install 'ktransformers[scale-out]'") from None
    return url.set(drivername="postgresql+psycopg")


def _lock_key(name: str) -> int:
    """A PostgreSQL advisory-lock key (signed 64 bits) for ``name``."""
    return int.from_bytes(hashlib.sha256(f"ktransformers:{name}".encode()).digest()[:8], "big", signed=True)


MIGRATION_LOCK = _lock_key("migrate")


def _connect_problem(e: BaseException, what: str, password: str | None) -> str:
    """One line saying why opening the database ``what`` failed, without its password."""
    orig = getattr(e, "orig", None) or e
    detail = " ".join(str(orig).split()) or type(orig).__name__
    if password:
        detail = detail.replace(password, "***")
    detail = re.sub(r"^connection failed: ", "", detail)
    return f"{what}: cannot open it ({detail[:300]})"


class Database:
    """The server's tables over SQLite in ``data_dir`` or, given ``url``, PostgreSQL shared by several
    server processes.  Opening migrates the schema to this version's head (or refuses a newer one)."""

    def __init__(self, data_dir: str | Path | None = None, *, url: str | None = None):
        from sqlalchemy.exc import DBAPIError

        #: this process's id in the ``owner`` column of the runs and responses it executes
        self.instance_id = uuid.uuid4().hex
        self._presence = None
        if url:
            self.url = parse_database_url(url)
            self.where = redact_url(url)
            connect_args = {"application_name": "ktransformers"}
            if "connect_timeout" not in self.url.query:
                connect_args["connect_timeout"] = CONNECT_TIMEOUT_S
            self.engine = create_engine(self.url, pool_pre_ping=True, connect_args=connect_args)
            writer = self.engine
        else:
            d = Path(data_dir if data_dir is not None else ".")
            d.mkdir(parents=True, exist_ok=True)
            self.path = private_file(d / DB_FILE)  # SQLite gives its -wal/-shm files the same mode
            self.url = make_url(f"sqlite:///{self.path}")
            self.where = str(self.path)
            self.engine = create_engine(self.url, connect_args={"check_same_thread": False, "timeout": 30})
            _sqlite_transactions(self.engine)
            writer = self.engine.execution_options(kt_write=True)
        self.shared = self.engine.dialect.name == "postgresql"
        try:
            migrate(writer)
            if self.shared:  # held until this process ends: others then know its rows are orphans
                self._presence = self.engine.connect()
                self._presence.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _lock_key(self.instance_id)})
                self._presence.commit()
        except DBAPIError as e:
            self.engine.dispose()
            what = f"--database_url {self.where}" if url else f"database {self.where}"
            raise ConfigError(_connect_problem(e, what, self.url.password)) from None
        except BaseException:  # a schema this version does not know, an interrupt: no connection left open
            self.engine.dispose()
            raise
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(writer, expire_on_commit=False, info={"owner": self.instance_id})
        event.listen(self._write_sessions, "before_flush", _stamp_owner)
        # SQLite: one writer per process at a time spares the others the busy wait
        self._write_lock = contextlib.nullcontext() if self.shared else threading.RLock()

    def close(self) -> None:
        if self._presence is not None:
            with contextlib.suppress(Exception):
                # released here, not when the server backend exits: that happens a moment after
                # the socket closes, and a server starting in that moment would take these rows as live
                self._presence.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _lock_key(self.instance_id)})
                self._presence.commit()
            with contextlib.suppress(Exception):
                self._presence.close()
            self._presence = None
        self.engine.dispose()

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        with self._sessions() as s:
            yield s

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        """One transaction, committed on leaving (rolled back on an exception)."""
        with self._write_lock, self._write_sessions() as s, s.begin():
            yield s

    # ---- helpers ----------------------------------------------------------------------
    @staticmethod
    def get(s: Session, cls, obj_id: str, what: str, *, lock: bool = False, missing: str | None = None):
        """The row of ``cls`` with ``obj_id`` (404 when none); ``lock``: held until the write commits.
        ``missing``: the 404's message where the API words it otherwise (``{id}`` for the id)."""
        q = select(cls).where(cls.id == obj_id)
        row = s.scalar(q.with_for_update() if lock else q)
        if row is None:
            text = missing.format(id=obj_id) if missing else f"No {what} found with id '{obj_id}'."
            raise APIError(404, text, param=f"{what}_id")
        return row

    @staticmethod
    def page(s: Session, cls, *filters, limit: int = 20, order: str = "desc", after: str | None = None,
             before: str | None = None) -> dict:
        """OpenAI list object: ``data``, ``first_id``, ``last_id``, ``has_more``."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be within 1..100 (got {limit})", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc' (got '{order}')", param="order")
        q = select(cls).where(*filters)
        for cursor, forward in ((after, True), (before, False)):
            if cursor:
                seq = s.scalar(select(cls.seq).where(cls.id == cursor))
                if seq is None:
                    raise UnknownCursor(cursor, "after" if forward else "before")
                q = q.where(cls.seq > seq if (order == "asc") == forward else cls.seq < seq)
        q = q.order_by(cls.seq.asc() if order == "asc" else cls.seq.desc()).limit(limit + 1)
        rows = list(s.scalars(q))
        has_more = len(rows) > limit
        data = [r.to_dict() for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    def owner_is_gone(self, s: Session, owner: str | None) -> bool:
        """Whether the process that wrote ``owner`` has ended (its unfinished rows can never finish).

        SQLite serves one process, so any owner but this one is gone; on PostgreSQL a live
        process holds the advisory lock of its id, so taking it (until this write commits) means gone."""
        if owner == self.instance_id:
            return False
        if owner is None or not self.shared:
            return True
        return bool(s.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": _lock_key(owner)}))

    def unfinished_orphans(self, s: Session, cls, statuses) -> list:
        """Rows of ``cls`` in one of ``statuses`` whose owner is gone, locked for this write."""
        # locked in one order (seq), so servers starting together cannot deadlock on them
        rows = list(s.scalars(select(cls).where(cls.status.in_(statuses)).order_by(cls.seq).with_for_update()))
        gone = {o: self.owner_is_gone(s, o) for o in {r.owner for r in rows}}
        return [r for r in rows if gone[r.owner]]

    def expire_unfinished_runs(self) -> int:
        """Runs a server process that is gone left unfinished cannot finish now: mark them failed."""
        now = int(time.time())
        with self.write() as s:
            runs = self.unfinished_orphans(s, Run, ACTIVE_RUN)
            for r in runs:
                r.status = "failed"
                r.failed_at = now
                r.last_error = {"code": "server_error", "message": "the server stopped before this run finished"}
                if r.message_id:
                    m = s.scalar(select(Message).where(Message.id == r.message_id))
                    if m is not None and m.status == "in_progress":
                        m.status, m.incomplete_at = "incomplete", now
                        m.incomplete_details = {"reason": "run_failed"}
            return len(runs)


def _stamp_owner(session: Session, _flush_context, _instances) -> None:
    """New rows that have an ``owner`` column get the writing process's id."""
    for obj in session.new:
        if hasattr(obj, "owner") and obj.owner is None:
            obj.owner = session.info["owner"]


def _sqlite_transactions(engine) -> None:
    """SQLite pragmas, and transactions SQLAlchemy begins itself: ``BEGIN IMMEDIATE`` for writes
    (the write lock is taken first, so a read-then-write never fails on another process's commit)."""

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # the driver begins nothing on its own: _begin below does
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("kt_write") else "BEGIN")


def migrate(engine) -> str:
    """Bring the schema to this version's head in one transaction; return the revision.

    Server processes starting together take turns (PostgreSQL: an advisory lock; SQLite: its
    write lock).  A database at a revision this version does not know is refused."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    script = ScriptDirectory.from_config(cfg)
    known = {r.revision for r in script.walk_revisions()}
    head = script.get_current_head()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        current = MigrationContext.configure(conn).get_current_heads()
        unknown = [r for r in current if r not in known]
        if unknown:
            where = conn.engine.url.render_as_string(hide_password=True)
            raise ConfigError(f"database {where}: schema revision {', '.join(unknown)} is newer than this "
                              f"ktransformers knows (its latest: {head}); upgrade ktransformers or use another "
                              "database")
        if current != (head,):
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    return head
