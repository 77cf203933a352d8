"""Assistants storage: SQLAlchemy models over one SQLite file in ``--data_dir``.

The file and tables are created on first start and reused afterwards.  Writes go through one
process-wide lock (and SQLite's WAL journal with a busy timeout), so concurrent requests never
lose each other's rows.  Rows are ordered by an autoincrement ``seq``; the public ids
(``asst_…``, ``thread_…``, ``msg_…``, ``run_…``) are separate unique columns.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import JSON, Boolean, Float, Integer, String, Text, create_engine, event, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from .errors import APIError, UnknownCursor

DB_FILE = "ktransformers.sqlite3"


class Base(DeclarativeBase):
    pass


class Assistant(Base):
    __tablename__ = "assistants"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    created_at: Mapped[int] = mapped_column(Integer)
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


class Thread(Base):
    __tablename__ = "threads"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    created_at: Mapped[int] = mapped_column(Integer)
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    tool_resources: Mapped[dict | None] = mapped_column(JSON, nullable=True)

    def to_dict(self) -> dict:
        return {"id": self.id, "object": "thread", "created_at": self.created_at, "metadata": self.meta or {},
                "tool_resources": self.tool_resources or {}}


class Message(Base):
    __tablename__ = "messages"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    thread_id: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[int] = mapped_column(Integer)
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


class Run(Base):
    __tablename__ = "runs"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    thread_id: Mapped[str] = mapped_column(String(64), index=True)
    assistant_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(Integer)
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


class Database:
    def __init__(self, data_dir: str | Path):
        d = Path(data_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.path = private_file(d / DB_FILE)  # SQLite gives its -wal/-shm files the same mode
        self.engine = create_engine(f"sqlite:///{self.path}",
                                    connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(self.engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        Base.metadata.create_all(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.RLock()

    def close(self) -> None:
        self.engine.dispose()

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        with self._sessions() as s:
            yield s

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        with self._write_lock, self._sessions() as s, s.begin():
            yield s

    # ---- helpers ----------------------------------------------------------------------
    @staticmethod
    def get(s: Session, cls, obj_id: str, what: str):
        row = s.scalar(select(cls).where(cls.id == obj_id))
        if row is None:
            raise APIError(404, f"No {what} found with id '{obj_id}'.", param=f"{what}_id")
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

    def expire_unfinished_runs(self) -> int:
        """Runs a previous server process left unfinished cannot finish now: mark them failed."""
        now = int(time.time())
        with self.write() as s:
            runs = list(s.scalars(select(Run).where(Run.status.in_(ACTIVE_RUN))))
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
