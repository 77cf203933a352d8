"""OpenAI Conversations API under ``/v1``: conversations (create, retrieve, update, delete) and
their items (list, create, retrieve, delete).  A response created with ``conversation`` reads the
items as its history and appends its input and output to them (see ``responses_api``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field
from sqlalchemy import delete, select

from .common import new_id
from .db import Database
from .errors import APIError
from .response_items import normalize_items, page_list
from .responses_store import ConversationItemRow, ConversationRow, add_conversation_items, conversation_items
from .schemas import INPUT_ITEM_SCHEMA, Metadata, _Req

router = APIRouter()
MAX_ITEMS_PER_CALL = 20


class ConversationCreate(_Req):
    items: list[dict[str, Any]] | None = Field(None, max_length=MAX_ITEMS_PER_CALL,
                                                json_schema_extra={"items": INPUT_ITEM_SCHEMA})
    metadata: Metadata = None


class ConversationUpdate(_Req):
    metadata: Metadata


class ItemsCreate(_Req):
    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS_PER_CALL,
                                        json_schema_extra={"items": INPUT_ITEM_SCHEMA})


def _db(request: Request) -> Database:
    return request.app.state.db


def _images(request: Request):
    """The model's ImageSupport when it takes images (its items may hold ``input_image`` parts)."""
    return getattr(request.app.state.engine, "images", None)


def conversation_row(s, conversation_id: str, *, lock: bool = False) -> ConversationRow:
    """The conversation (404 when none); ``lock``: no other writer adds to or deletes it until this write commits."""
    return Database.get(s, ConversationRow, conversation_id, "conversation", lock=lock,
                        missing="Conversation with id '{id}' not found.")


def _item(s, conversation_id: str, item_id: str) -> ConversationItemRow:
    it = s.scalar(select(ConversationItemRow).where(ConversationItemRow.id == item_id,
                                                    ConversationItemRow.conversation_id == conversation_id))
    if it is None:
        raise APIError(404, f"Item with id '{item_id}' not found in conversation '{conversation_id}'.",
                       param="item_id")
    return it


@router.post("/conversations")
def create_conversation(request: Request, body: ConversationCreate | None = None):
    body = body or ConversationCreate()
    meta = dict(body.metadata or {})
    items = normalize_items(body.items or [], "items", _images(request))
    c = ConversationRow(id=new_id("conv_"), created_at=int(time.time()), meta=meta)
    with _db(request).write() as s:
        s.add(c)
        add_conversation_items(s, c.id, items)
    return c.to_dict()


@router.get("/conversations/{conversation_id}")
def get_conversation(conversation_id: str, request: Request):
    with _db(request).read() as s:
        return conversation_row(s, conversation_id).to_dict()


@router.post("/conversations/{conversation_id}")
def update_conversation(conversation_id: str, body: ConversationUpdate, request: Request):
    meta = dict(body.metadata or {})
    with _db(request).write() as s:
        c = conversation_row(s, conversation_id, lock=True)
        c.meta = meta
    return c.to_dict()


@router.delete("/conversations/{conversation_id}")
def delete_conversation(conversation_id: str, request: Request):
    with _db(request).write() as s:
        s.delete(conversation_row(s, conversation_id, lock=True))
        s.execute(delete(ConversationItemRow).where(ConversationItemRow.conversation_id == conversation_id))
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/conversations/{conversation_id}/items")
def list_items(conversation_id: str, request: Request, limit: int = 20, order: str = "desc",
               after: str | None = None):
    with _db(request).read() as s:
        conversation_row(s, conversation_id)
        return page_list(conversation_items(s, conversation_id), limit=limit, order=order, after=after)


@router.post("/conversations/{conversation_id}/items")
def create_items(conversation_id: str, body: ItemsCreate, request: Request):
    items = normalize_items(body.items, "items", _images(request))
    with _db(request).write() as s:
        conversation_row(s, conversation_id, lock=True)
        add_conversation_items(s, conversation_id, items)
    return {"object": "list", "data": items, "first_id": items[0]["id"], "last_id": items[-1]["id"],
            "has_more": False}


@router.get("/conversations/{conversation_id}/items/{item_id}")
def get_item(conversation_id: str, item_id: str, request: Request):
    with _db(request).read() as s:
        conversation_row(s, conversation_id)
        return _item(s, conversation_id, item_id).to_dict()


@router.delete("/conversations/{conversation_id}/items/{item_id}")
def delete_item(conversation_id: str, item_id: str, request: Request):
    with _db(request).write() as s:
        c = conversation_row(s, conversation_id, lock=True)
        s.delete(_item(s, conversation_id, item_id))
    return c.to_dict()
