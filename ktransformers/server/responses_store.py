"""Storage of Responses and Conversations: tables in the same database as the Assistants data.

The tables share :class:`~.db.Database`'s engine, migrations and transactions, so its promises
hold here too: a write that was answered is committed (a ``kill -9`` loses nothing
acknowledged).  A response's row is written before its generation starts and its output saved
as it grows; responses a server process that is gone left ``queued`` / ``in_progress`` are marked
``incomplete`` when a server starts.
"""

from __future__ import annotations

import time

from sqlalchemy import JSON, Boolean, Integer, String, false, select
from sqlalchemy.orm import Mapped, mapped_column

from .db import Base, Database, StoredObject
from .errors import APIError

UNFINISHED = ("queued", "in_progress")


class ResponseRow(StoredObject, Base):
    __tablename__ = "responses"
    status: Mapped[str] = mapped_column(String(16))
    previous_response_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    conversation_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    data: Mapped[dict] = mapped_column(JSON)  # the response object as the API returns it
    input_items: Mapped[list] = mapped_column(JSON, default=list)  # this request's own input items
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)  # Database.instance_id generating it
    #: a cancel asked through another server sharing the database; the owner stops at its next save
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    def to_dict(self) -> dict:
        return dict(self.data)


class ConversationRow(StoredObject, Base):
    __tablename__ = "conversations"
    meta: Mapped[dict] = mapped_column("metadata", JSON, default=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.meta or {}}


class ConversationItemRow(StoredObject, Base):
    __tablename__ = "conversation_items"
    conversation_id: Mapped[str] = mapped_column(String(64), index=True)
    data: Mapped[dict] = mapped_column(JSON)  # the item (message, function_call, …) with its id

    def to_dict(self) -> dict:
        return dict(self.data)


def expire_unfinished_responses(db: Database) -> int:
    """Responses a server process that is gone left unfinished cannot finish now: mark them incomplete."""
    with db.write() as s:
        rows = db.unfinished_orphans(s, ResponseRow, UNFINISHED)
        for r in rows:
            r.status = "incomplete"
            r.data = dict(r.data, status="incomplete",
                          incomplete_details={"reason": "interrupted"},
                          output=[dict(o, status="incomplete") if o.get("status") == "in_progress" else o
                                  for o in r.data.get("output", [])])
        return len(rows)


def add_conversation_items(s, conversation_id: str, items: list[dict]) -> None:
    now = int(time.time())
    for it in items:
        s.add(ConversationItemRow(id=it["id"], conversation_id=conversation_id, created_at=now, data=it))


def conversation_items(s, conversation_id: str) -> list[dict]:
    rows = s.scalars(select(ConversationItemRow).where(ConversationItemRow.conversation_id == conversation_id)
                     .order_by(ConversationItemRow.seq.asc()))
    return [r.to_dict() for r in rows]


def response_chain_items(s, response_id: str, max_depth: int = 10_000) -> list[dict]:
    """Input and output items of ``response_id`` and every response before it, oldest first."""
    chunks: list[list[dict]] = []
    rid, seen = response_id, set()
    while rid and rid not in seen and len(seen) < max_depth:
        seen.add(rid)
        row = s.scalar(select(ResponseRow).where(ResponseRow.id == rid))
        if row is None:
            if rid == response_id:
                raise APIError(404, f"Previous response with id '{rid}' not found.", param="previous_response_id")
            break  # an older link was deleted: the chain starts here
        chunks.append(list(row.input_items or []) + list(row.data.get("output") or []))
        rid = row.previous_response_id
    return [it for chunk in reversed(chunks) for it in chunk]
