"""Responses / Conversations input items, shared by both routers (``responses_api``,
``conversations_api``): request items checked and turned into stored items with ids, stored items
turned into chat messages, and the OpenAI list page over stored items."""

from __future__ import annotations

from typing import Any

from .common import new_id
from .errors import APIError, UnknownCursor
from .prompting import IMAGE_PART_KINDS, content_text
from .schemas import json_type_name


def _text_part(role: str, text: str) -> dict:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def message_item(role: str, text: str) -> dict:
    return {"type": "message", "id": new_id("msg_"), "role": role, "status": "completed",
            "content": [_text_part(role, text)]}


def _checked_parts(content: Any, where: str) -> Any:
    """Content must be a string or a list of part objects whose ``text`` is a string."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"'{where}' must be a string or a list of content parts", param=where)
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise APIError(400, f"'{where}[{j}]' must be a content part object", param=where)
        if "text" in part and not isinstance(part["text"], str):
            raise APIError(400, f"'{where}[{j}].text' must be a string", param=where)
    return content


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_KINDS
                                             for p in content)


def _message_with_images(role: str, content: list, where: str, images) -> dict:
    """A message item keeping its parts in order: text parts and ``input_image`` parts (their
    ``image_url``, a data: URL), each image decoded and checked now by ``images`` (an
    ``ImageCollector``), so that a bad one is a 400 naming its part here, not a later continuation's."""
    content_text(content, where, images)  # the chat route's checks and errors, image by image
    parts = []
    for p in content:
        if isinstance(p, dict) and p.get("type") in IMAGE_PART_KINDS:
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append({"type": "input_image", "image_url": url, "detail": p.get("detail") or "auto"})
        else:
            parts.append(_text_part(role, content_text([p], where)))
    return {"type": "message", "id": new_id("msg_"), "role": role, "status": "completed", "content": parts}


def normalize_items(raw: Any, param: str = "input", images=None) -> list[dict]:
    """Input items (a string, or messages / function calls / their outputs) → stored items with ids.

    ``images``: the model's ``multimodal.chat.ImageSupport`` when it takes images (None: text only,
    an image part is a 400); a message's ``input_image`` parts are checked and stored with it."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [message_item("user", raw)]
    collector = images.collector() if images is not None else None  # --max_images counts the whole input
    out = []
    for i, it in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(it.get("type"), (str, type(None))):
            raise APIError(400, f"'{where}.type' must be a string, not {json_type_name(it['type'])}",
                           param=f"{where}.type")
        kind = it.get("type") or ("message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"'{where}.role' must be user, assistant, system or developer (got {role!r})",
                               param=f"{where}.role")
            if it.get("content") is None:
                raise APIError(400, f"'{where}.content' is required: a string or a list of content parts",
                               param=f"{where}.content")
            content = _checked_parts(it.get("content"), f"{where}.content")
            if collector is not None and _has_images(content):
                item = _message_with_images(role, content, f"{where}.content", collector)
            else:
                item = message_item(role, content_text(content, f"{where}.content"))
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(it.get(k), str):
                    raise APIError(400, f"'{where}.{k}' must be a string", param=f"{where}.{k}")
            item = {"type": "function_call", "id": new_id("fc_"), "call_id": it["call_id"], "name": it["name"],
                    "arguments": it["arguments"], "status": "completed"}
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise APIError(400, f"'{where}.call_id' must be a string", param=f"{where}.call_id")
            output = it.get("output")
            output = output if isinstance(output, str) else content_text(_checked_parts(output, f"{where}.output"),
                                                                         f"{where}.output")
            item = {"type": "function_call_output", "id": new_id("fco_"), "call_id": it["call_id"],
                    "output": output, "status": "completed"}
        elif kind == "reasoning":
            for k in ("summary", "content"):
                if it.get(k) is not None and not isinstance(it[k], list):
                    raise APIError(400, f"'{where}.{k}' must be a list", param=f"{where}.{k}")
            item = {"type": "reasoning", "id": new_id("rs_"), "summary": list(it.get("summary") or []),
                    "content": list(it.get("content") or []), "status": "completed"}
        else:
            raise APIError(400, f"'{where}.type' {kind!r} is not supported (supported: message, function_call, "
                                "function_call_output, reasoning)", param=f"{where}.type")
        out.append(item)
    return out


def items_to_messages(items: list[dict]) -> list[dict]:
    """Stored items → chat messages; consecutive function calls join one assistant message."""
    msgs: list[dict] = []
    for it in items:
        kind = it.get("type")
        if kind == "message":
            content = it.get("content")  # with pictures: the parts, which the chat prompt decodes again
            msgs.append({"role": it["role"], "content": list(content) if _has_images(content)
                         else content_text(content, "input")})
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it.get("output", "")})
        # reasoning items are not sent back to the model (as DeepSeek's and Qwen's templates do)
    return msgs


def page_list(data: list[dict], *, limit: int, order: str, after: str | None, before: str | None = None) -> dict:
    """OpenAI list page over ``data`` (oldest first)."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be within 1..100 (got {limit})", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc' (got '{order}')", param="order")
    items = data if order == "asc" else list(reversed(data))
    ids = [d["id"] for d in items]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor and cursor not in ids:
            raise UnknownCursor(cursor, name)
    if after:
        items = items[ids.index(after) + 1:]
    if before:
        cut = [d["id"] for d in items]
        items = items[:cut.index(before)] if before in cut else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
