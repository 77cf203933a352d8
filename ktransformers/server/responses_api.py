"""OpenAI Responses API under ``/v1``: ``POST /responses`` (plain, streamed, background),
``GET``/``DELETE /responses/{id}``, ``GET /responses/{id}/input_items``, ``POST /responses/{id}/cancel``.

One code path turns the engine's tokens into output items for all three modes: the model text
goes through :class:`~.prompting.OutputParser` (``<think>`` → a ``reasoning`` item and, with
function tools, tool calls → ``function_call`` items); the typed
events it produces are sent as SSE when streaming and simply drained otherwise, so a streamed
answer and a plain one are the same.  History comes from ``previous_response_id`` (the chain of
stored responses) or ``conversation`` (its items, to which the input and output are appended).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field, field_validator
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from . import conversations_api
from .common import SSE_HEADERS, JobRegistry, cancel_on_disconnect, check_model, new_id, sse, stop_list
from .db import Database
from .engine import Engine, GenerationRequest, QueueFull
from .errors import STREAMS_SSE, APIError
from .prompting import ChatPrompt
from .response_items import items_to_messages, message_item, normalize_items, page_list  # noqa: F401 - public here too
from .responses_store import (UNFINISHED, ConversationRow, ResponseRow, add_conversation_items,
                              conversation_items, expire_unfinished_responses, response_chain_items)
from .schemas import (FUNCTION_TOOL_SCHEMA, INPUT_ITEM_SCHEMA, Metadata, ModelName, Seed, StopType, _Req,
                      tool_name_problem)

router = APIRouter()
log = logging.getLogger("ktransformers.server")

_SAVE_EVERY_S = 1.0
# ---- request ------------------------------------------------------------------------------

class ResponseCreate(_Req):
    model_config = ConfigDict(json_schema_extra={"allOf": [  # what _prepare checks across fields
        {"anyOf": [{"required": ["input"], "properties": {"input": {"anyOf": [
            {"type": "string"}, {"type": "array", "minItems": 1}]}}},
            {"required": ["conversation"], "properties": {"conversation": {"not": {"type": "null"}}}}]},
        {"not": {"required": ["previous_response_id", "conversation"], "properties": {
            "previous_response_id": {"type": "string", "minLength": 1}, "conversation": {"not": {"type": "null"}}}}},
        {"if": {"required": ["background"], "properties": {"background": {"const": True}}},
         "then": {"properties": {"store": {"const": True}, "stream": {"const": False}}}},
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
         "then": {"required": ["tools"], "properties": {"tools": {"minItems": 1}}}}]})
    model: ModelName | None = None
    #: a string or a list of items; checked by normalize_items so the error names the item
    input: Any = Field(None, json_schema_extra={"anyOf": [{"type": "string"}, {"type": "null"},
                                                          {"type": "array", "items": INPUT_ITEM_SCHEMA}]})
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # extension
    seed: Seed | None = None  # extension
    stop: StopType = None  # extension (the Responses API has none)
    store: bool = True
    stream: bool = False
    background: bool = False
    previous_response_id: str | None = None
    conversation: Any = Field(None, json_schema_extra={"anyOf": [  # an id or {"id": …}
        {"type": "string", "minLength": 1}, {"type": "object", "required": ["id"], "properties": {"id": {"type": "string", "minLength": 1}}},
        {"type": "null"}]})
    tools: list[dict[str, Any]] = Field(default_factory=list, json_schema_extra={"items": FUNCTION_TOOL_SCHEMA})
    #: none / auto / required / {"type": "function", "name": …} naming one of 'tools' (chat_tools checks it)
    tool_choice: Any = Field(None, json_schema_extra={"anyOf": [
        {"enum": ["none", "auto", "required", None]},
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "function"}}, "anyOf": [
            {"required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}},
            {"required": ["function"], "properties": {"function": {
                "type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}}}]}]})
    parallel_tool_calls: bool = True
    metadata: Metadata = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _input_shape(cls, v):
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
            return v
        raise ValueError("must be a string or a list of input items (objects)")

    @field_validator("conversation")
    @classmethod
    def _conversation_shape(cls, v):
        if v is None or (isinstance(v, str) and v) or (isinstance(v, dict) and isinstance(v.get("id"), str)):
            return v
        raise ValueError("must be a conversation id or {\"id\": …}")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, v):
        if v is None or v in ("none", "auto", "required") or isinstance(v, dict):
            return v
        raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": …}")


def chat_tools(tools: list[dict], tool_choice: Any) -> list[dict]:
    """Responses function tools (flat) → chat ``tools``; other tool types are refused."""
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"'tools[{i}].type' {t.get('type')!r} is not supported: this server runs "
                                "function tools only", param=f"tools[{i}].type")
        if not t.get("name"):
            raise APIError(400, f"'tools[{i}].name' is required", param=f"tools[{i}].name")
        problem = tool_name_problem(t["name"])
        if problem:
            raise APIError(400, f"'tools[{i}].name': {problem}", param=f"tools[{i}].name")
        fn = {"name": t["name"], "description": t.get("description"), "parameters": t.get("parameters")}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = tool_choice.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
        if tool_choice.get("type") != "function" or not name or not isinstance(name, str):
            raise APIError(400, "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                                "\"name\": …}", param="tool_choice")
        if name not in [t["function"]["name"] for t in out]:
            raise APIError(400, f"'tool_choice' names '{name}', which is not in 'tools'", param="tool_choice")
    elif tool_choice in ("required",) and not out:
        raise APIError(400, "'tool_choice' is 'required' but no tools are given", param="tool_choice")
    return out


def conversation_id_of(conv: Any) -> str | None:
    if conv is None:
        return None
    cid = conv if isinstance(conv, str) else conv.get("id")
    if not isinstance(cid, str) or not cid:
        raise APIError(400, "'conversation' must be a conversation id or {\"id\": …}", param="conversation")
    return cid


# ---- one response -------------------------------------------------------------------------

@dataclass
class Job:
    """A response being generated: its request, snapshot fields and engine stream."""

    id: str
    created_at: int
    model: str
    body: ResponseCreate
    ids: list[int]
    input_items: list[dict]
    conversation_id: str | None
    use_tools: bool
    prompt: ChatPrompt  # how to read the answer (reasoning, harmony)
    metadata: dict
    status: str = "in_progress"
    stream: Any = None
    cancelled: bool = False
    task: asyncio.Task | None = None
    output: list[dict] = field(default_factory=list)

    def snapshot(self, *, status: str | None = None, usage: dict | None = None, error: dict | None = None,
                 incomplete: dict | None = None) -> dict:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status or self.status,
            "background": b.background, "error": error, "incomplete_details": incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": [dict(o) for o in self.output], "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "conversation": {"id": self.conversation_id} if self.conversation_id else None,
            "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
            "store": b.store, "temperature": b.temperature, "top_p": b.top_p,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools, "truncation": b.truncation or "disabled",
            "usage": usage, "user": b.user, "metadata": self.metadata,
            "completed_at": int(time.time()) if (status or self.status) == "completed" else None,
        }


class OutputBuilder:
    """Output items and their typed events from ("reasoning" | "text" | "call", value) pieces."""

    def __init__(self, job: Job, event):
        self.job, self.event = job, event
        self.open: dict | None = None  # the reasoning or message item being written
        self.pending_ws = ""  # whitespace before any message text: dropped if a call or the end follows
        self.n_calls = 0

    @property
    def index(self) -> int:
        return len(self.job.output) - 1

    def _start(self, item: dict, part: dict | None) -> list[dict]:
        self.job.output.append(item)
        evs = [self.event("response.output_item.added", output_index=self.index,
                          item=dict(item, content=[]) if part is not None else dict(item))]
        if part is not None:
            item["content"] = [part]
            evs.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                  content_index=0, part=dict(part)))
        return evs

    def close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        base = dict(item_id=item["id"], output_index=self.index, content_index=0)
        if item["type"] == "message":
            evs = [self.event("response.output_text.done", **base, text=part["text"], logprobs=[])]
        else:
            evs = [self.event("response.reasoning_text.done", **base, text=part["text"])]
        evs.append(self.event("response.content_part.done", **base, part=dict(part)))
        evs.append(self.event("response.output_item.done", output_index=self.index, item=dict(item)))
        return evs

    def reasoning(self, text: str) -> list[dict]:
        evs = []
        if self.open is None or self.open["type"] != "reasoning":
            evs += self.close()
            item = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "status": "in_progress"}
            evs += self._start(item, {"type": "reasoning_text", "text": ""})
            self.open = item
        self.open["content"][0]["text"] += text
        evs.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=self.index,
                              content_index=0, delta=text))
        return evs

    def text(self, text: str) -> list[dict]:
        evs = []
        if self.open is None or self.open["type"] != "message":
            if not (self.pending_ws + text).strip():
                self.pending_ws += text
                return []
            text, self.pending_ws = self.pending_ws + text, ""
            evs += self.close()
            item = {"type": "message", "id": new_id("msg_"), "role": "assistant", "status": "in_progress"}
            evs += self._start(item, {"type": "output_text", "text": "", "annotations": []})
            self.open = item
        self.open["content"][0]["text"] += text
        evs.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=self.index,
                              content_index=0, delta=text, logprobs=[]))
        return evs

    def call(self, call: dict) -> list[dict]:
        if self.n_calls and not self.job.body.parallel_tool_calls:
            return []  # one call per turn was asked for
        self.n_calls += 1
        self.pending_ws = ""
        evs = self.close()
        fn = call["function"]
        item = {"type": "function_call", "id": new_id("fc_"), "call_id": call["id"], "name": fn["name"],
                "arguments": "", "status": "in_progress"}
        evs += self._start(item, None)
        base = dict(item_id=item["id"], output_index=self.index)
        item["arguments"] = fn["arguments"]
        evs.append(self.event("response.function_call_arguments.delta", **base, delta=fn["arguments"]))
        evs.append(self.event("response.function_call_arguments.done", **base, arguments=fn["arguments"],
                              name=fn["name"]))
        item["status"] = "completed"
        evs.append(self.event("response.output_item.done", output_index=self.index, item=dict(item)))
        return evs


class ResponseRegistry(JobRegistry):
    """Responses generating in this process (``Job`` by response id), for ``cancel``."""


def _save(db: Database, job: Job, resp: dict, *, final: bool) -> bool:
    """Write the response's current state; at the end also append its output to the conversation.
    True when a cancel was asked through another server sharing the database."""
    cancel = False
    with db.write() as s:
        if job.body.store:
            row = s.scalar(select(ResponseRow).where(ResponseRow.id == job.id).with_for_update())
            if row is not None:
                row.status, row.data = resp["status"], resp
                cancel = bool(row.cancel_requested)
        if final and job.conversation_id and resp["output"]:
            if s.scalar(select(ConversationRow).where(ConversationRow.id == job.conversation_id)
                        .with_for_update()) is not None:  # not deleted meanwhile, nor while appending
                add_conversation_items(s, job.conversation_id,
                                       [o for o in resp["output"] if o.get("status") != "in_progress"])
    return cancel


def _usage(job: Job, n_out: int, n_reasoning: int) -> dict:
    n_in = len(job.ids)
    cached = job.stream.cached_tokens if getattr(job, "stream", None) is not None else 0
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": n_reasoning}, "total_tokens": n_in + n_out}


def generation_request(job: Job) -> GenerationRequest:
    b = job.body
    return GenerationRequest(job.ids, temperature=b.temperature, top_p=b.top_p, top_k=b.top_k,
                             max_new_tokens=b.max_output_tokens, stop=stop_list(b.stop), seed=b.seed,
                             tag="openai.responses")


async def run_job(app, job: Job) -> AsyncIterator[dict]:
    """The typed events of one response, from ``response.created`` to its terminal event.

    The response row is kept up to date on the way; however the iteration ends (client gone,
    cancel, error), the generation is stopped and the row left in a final state."""
    db: Database = app.state.db
    engine: Engine = app.state.engine
    seq = itertools.count()

    def event(type_: str, **kw) -> dict:
        return {"type": type_, "sequence_number": next(seq), **kw}

    req = generation_request(job)
    builder = OutputBuilder(job, event)
    finished = False
    try:
        yield event("response.created", response=job.snapshot())
        while job.stream is None:  # a background response waits out a full queue
            if job.cancelled:
                break
            try:
                job.stream = await engine.submit(req)
            except QueueFull:
                await asyncio.sleep(0.5)
        if job.status == "queued" and not job.cancelled:
            job.status = "in_progress"
            await run_in_threadpool(_save, db, job, job.snapshot(), final=False)
        if not job.cancelled:
            yield event("response.in_progress", response=job.snapshot())
        parser = job.prompt.parser(job.use_tools)
        n_out = n_reasoning = 0
        reason = "cancelled" if job.cancelled else "stop"
        last_save = time.monotonic()

        def pieces(items):
            evs = []
            for kind, val in items:
                evs += getattr(builder, kind)(val)  # reasoning / text / call
            return evs

        if job.stream is not None:
            async for ev in job.stream:
                if ev.token_id is not None:
                    n_out += 1
                    n_reasoning += parser.thinking
                if ev.finish_reason:
                    reason = ev.finish_reason
                if ev.text:
                    for e in pieces(parser.feed(ev.text)):
                        yield e
                if time.monotonic() - last_save > _SAVE_EVERY_S:  # partial answers survive a crash
                    last_save = time.monotonic()
                    if await run_in_threadpool(_save, db, job, job.snapshot(), final=False):
                        app.state.responses.cancel(job.id)  # asked through another server
        for e in pieces(parser.finish()):
            yield e
        usage = _usage(job, n_out, n_reasoning)
        if job.cancelled or reason == "cancelled":
            job.status = "cancelled"
            for e in builder.close("incomplete"):
                yield e
            resp = job.snapshot(usage=usage)
            await run_in_threadpool(_save, db, job, resp, final=True)
            finished = True
            return
        incomplete = reason == "length"
        for e in builder.close("incomplete" if incomplete else "completed"):
            yield e
        job.status = "incomplete" if incomplete else "completed"
        resp = job.snapshot(usage=usage, incomplete={"reason": "max_output_tokens"} if incomplete else None)
        await run_in_threadpool(_save, db, job, resp, final=True)
        finished = True
        yield event("response.incomplete" if incomplete else "response.completed", response=resp)
    except APIError as e:
        log.warning("response %s failed: %s", job.id, e.message)
        job.status = "failed"
        err = {"code": "server_error" if e.status >= 500 else "invalid_prompt", "message": e.message}
        resp = job.snapshot(error=err)
        with contextlib.suppress(Exception):
            await run_in_threadpool(_save, db, job, resp, final=True)
        finished = True
        yield event("response.failed", response=resp)
    finally:
        if job.stream is not None:
            job.stream.cancel()
        app.state.responses.active.pop(job.id, None)
        if not finished:  # the client went away mid-stream: keep what was generated, as cancelled
            job.status = "cancelled"
            for o in job.output:
                if o.get("status") == "in_progress":
                    o["status"] = "incomplete"
            with contextlib.suppress(Exception):
                _save(db, job, job.snapshot(), final=True)


def _prepare(app, body: ResponseCreate) -> Job:
    """Validate, build the prompt and write the response row (and the conversation's new input)."""
    db: Database = app.state.db
    engine: Engine = app.state.engine
    from .openai_api import refuse_structured_output, request_prompt

    model = check_model(engine, body.model)
    metadata = dict(body.metadata or {})
    refuse_structured_output((body.text or {}).get("format"), "text.format")
    conv_id = conversation_id_of(body.conversation)
    if conv_id and body.previous_response_id:
        raise APIError(400, "'previous_response_id' and 'conversation' cannot be used together",
                       param="previous_response_id")
    if body.background and not body.store:
        raise APIError(400, "background responses must be stored: 'store' cannot be false", param="store")
    if body.background and body.stream:
        raise APIError(400, "streaming a background response is not supported by this server", param="stream")
    items = normalize_items(body.input, images=getattr(engine, "images", None))
    if not items and not conv_id:
        raise APIError(400, "'input' is required", param="input")
    use_tools = bool(body.tools) and body.tool_choice != "none"
    tools = chat_tools(body.tools or [], body.tool_choice)  # also checks a choice that needs tools
    with db.read() as s:
        if conv_id:
            if s.scalar(select(ConversationRow).where(ConversationRow.id == conv_id)) is None:
                raise APIError(404, f"Conversation with id '{conv_id}' not found.", param="conversation")
            history = conversation_items(s, conv_id)
        elif body.previous_response_id:
            history = response_chain_items(s, body.previous_response_id)
        else:
            history = []
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + \
        items_to_messages(history + items)
    if not messages:
        raise APIError(400, "nothing to answer: 'input' and the conversation are empty", param="input")
    effort = (body.reasoning or {}).get("effort")
    prompt = request_prompt(app, messages, tools if use_tools else None, body.tool_choice, effort=effort)
    ids = prompt.ids
    job = Job(id=new_id("resp_"), created_at=int(time.time()), model=model, body=body, ids=ids, input_items=items,
              conversation_id=conv_id, use_tools=use_tools, metadata=metadata,
              prompt=prompt,
              status="queued" if body.background else "in_progress")
    engine.make_params(generation_request(job))  # 400s before anything is written
    return job


def _insert(db: Database, job: Job) -> None:
    """The response row and the conversation's new input, once the engine has taken the request."""
    body, items, conv_id = job.body, job.input_items, job.conversation_id
    with db.write() as s:
        if body.store:
            s.add(ResponseRow(id=job.id, created_at=job.created_at, status=job.status,
                              previous_response_id=body.previous_response_id, conversation_id=conv_id,
                              data=job.snapshot(), input_items=items))
        if conv_id and items:
            conversations_api.conversation_row(s, conv_id, lock=True)  # still there: another server may delete it
            add_conversation_items(s, conv_id, items)


@router.post("/responses", responses=STREAMS_SSE)
async def create_response(body: ResponseCreate, request: Request):
    app = request.app
    job = await run_in_threadpool(_prepare, app, body)
    registry: ResponseRegistry = app.state.responses
    if not body.background:  # a full queue answers 503 before anything is written
        job.stream = await app.state.engine.submit(generation_request(job))
    try:
        await run_in_threadpool(_insert, app.state.db, job)
    except BaseException:
        if job.stream is not None:
            job.stream.cancel()
        raise
    registry.active[job.id] = job
    events = run_job(app, job)

    if body.background:
        async def drain():
            async for _ in events:
                pass

        first = await events.__anext__()  # response.created: the job is registered and queued
        job.task = asyncio.create_task(drain())
        return first["response"]

    if not body.stream:
        last = None
        try:
            first = await events.__anext__()
            async with _cancel_when_gone(request, job):
                last = first
                async for ev in events:
                    last = ev
        finally:
            await events.aclose()
        return last["response"] if last and "response" in last else job.snapshot()

    async def body_events():
        try:
            async for ev in events:
                yield sse(ev, ev["type"])
        finally:
            with contextlib.suppress(BaseException):
                await events.aclose()

    return StreamingResponse(body_events(), media_type="text/event-stream", headers=SSE_HEADERS)


@contextlib.asynccontextmanager
async def _cancel_when_gone(request: Request, job: Job):
    """A plain (not streamed) request whose client disconnects stops its generation."""

    class _Proxy:
        def cancel(self):
            job.cancelled = True
            if job.stream is not None:
                job.stream.cancel()

    async with cancel_on_disconnect(request, _Proxy()):
        yield


def _row(s, response_id: str, *, lock: bool = False) -> ResponseRow:
    return Database.get(s, ResponseRow, response_id, "response", lock=lock,
                        missing="Response with id '{id}' not found.")


@router.get("/responses/{response_id}")
def get_response(response_id: str, request: Request):
    with request.app.state.db.read() as s:
        return _row(s, response_id).to_dict()


@router.delete("/responses/{response_id}")
def delete_response(response_id: str, request: Request):
    request.app.state.responses.cancel(response_id)
    with request.app.state.db.write() as s:
        s.delete(_row(s, response_id))
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request):
    db: Database = request.app.state.db
    registry: ResponseRegistry = request.app.state.responses

    def read():
        with db.read() as s:
            return _row(s, response_id)

    row = await run_in_threadpool(read)
    if not row.data.get("background"):
        raise APIError(400, "Only background responses can be cancelled.", param="response_id")
    job = registry.active.get(response_id)
    if job is not None:
        registry.cancel(response_id)
        if job.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(job.task), timeout=30)
    elif row.status in UNFINISHED:
        def ask() -> bool:
            """Flag it for the server generating it; False when no live server does."""
            with db.write() as s:
                r = _row(s, response_id, lock=True)
                r.cancel_requested = True
                return r.status in UNFINISHED and not db.owner_is_gone(s, r.owner)

        if await run_in_threadpool(ask):  # that server stops it at its next save: wait as for our own
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (await run_in_threadpool(read)).status in UNFINISHED:
                await asyncio.sleep(0.2)
    return (await run_in_threadpool(read)).to_dict()


@router.get("/responses/{response_id}/input_items")
def list_input_items(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                     after: str | None = None, before: str | None = None):
    with request.app.state.db.read() as s:
        row = _row(s, response_id)
        return page_list(list(row.input_items or []), limit=limit, order=order, after=after, before=before)


def install(app) -> None:
    """Mount the Responses and Conversations routes on ``app``; mark responses of gone servers incomplete."""
    db: Database = app.state.db
    expired = expire_unfinished_responses(db)
    if expired:
        log.warning("marked %d response(s) left unfinished by a previous server as incomplete", expired)
    app.state.responses = ResponseRegistry()
    app.include_router(router, prefix="/v1")
    app.include_router(conversations_api.router, prefix="/v1")
