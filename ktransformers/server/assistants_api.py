"""OpenAI Assistants (beta) routes under ``/v1``: assistants, threads, messages, runs, run steps.

A run turns the thread's messages (after the assistant's instructions) into one new assistant
message.  Runs execute as background tasks on the engine; ``stream: true`` follows the run as
server-sent events (``thread.run.created`` … ``thread.message.delta`` … ``done``).  A streaming
client that disconnects cancels its run; ``POST …/runs/{id}/cancel`` cancels any run.
Extensions: ``GET /v1/threads`` lists threads (the web page's conversation list).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import delete, select
from starlette.concurrency import run_in_threadpool

from .common import SSE_HEADERS, Collected, JobRegistry, check_model, new_id, pieces, sse
from .db import ACTIVE_RUN, Assistant, Database, Message, Run, Thread
from .engine import Engine, GenerationRequest, QueueFull
from .errors import STREAMS_SSE, APIError
from .prompting import IMAGE_PART_KINDS, content_text, with_images
from .schemas import (AssistantCreate, AssistantModify, MessageCreate, MetadataModify, RunCreate, RunModify,
                      ThreadAndRunCreate, ThreadCreate, json_type_name)

router = APIRouter()
Limit = Annotated[int, Query(ge=1, le=100)]
Order = Annotated[Literal["asc", "desc"], Query()]
log = logging.getLogger("ktransformers.server")

_SAVE_EVERY_S = 1.0


def _db(request: Request) -> Database:
    return request.app.state.db


def _now() -> int:
    return int(time.time())


def _has_images(content) -> bool:
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_KINDS
                                             for p in content)


def _parts(content, param: str, images=None) -> list[dict]:
    """A thread message's content as stored; a text part without its text is a 400 naming it (a
    stored message with no text would only fail later, in every run of the thread).  ``images``:
    the model's ``ImageSupport`` when it takes images; its ``image_url`` parts are then checked
    (the chat route's decoding and errors) and stored in order beside the text parts."""
    for j, part in enumerate(content if isinstance(content, list) else []):
        text = part.get("text") if isinstance(part, dict) else part
        if isinstance(part, dict) and part.get("type", "text") not in ("text", "input_text", "output_text"):
            continue  # content_text names the unsupported kind
        if isinstance(text, dict):
            if not isinstance(text.get("value"), str):
                raise APIError(400, f"'{param}[{j}].text.value' must be a string, not "
                                    f"{json_type_name(text.get('value'))}", param=param)
        elif text is None:  # other types: content_text names them
            raise APIError(400, f"'{param}[{j}].text' is required: a string or {{\"value\": string}}", param=param)
    collector = images.collector() if images is not None else None
    if collector is not None and _has_images(content):
        content_text(content, param, collector)  # each picture decoded and checked now
        out = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in IMAGE_PART_KINDS:
                url = p.get("image_url")
                detail = (url.get("detail") if isinstance(url, dict) else None) or "auto"
                url = url.get("url") if isinstance(url, dict) else url
                out.append({"type": "image_url", "image_url": {"url": url, "detail": detail}})
            else:
                out.append({"type": "text", "text": {"value": content_text([p], param), "annotations": []}})
        return out
    text = content_text(content, param, collector)
    return [{"type": "text", "text": {"value": text, "annotations": []}}]


def _meta(m) -> dict:
    """Metadata as stored (the request models check OpenAI's limits)."""
    return dict(m or {})


# ---- assistants ---------------------------------------------------------------------------

@router.post("/assistants")
def create_assistant(body: AssistantCreate, request: Request):
    model = check_model(request.app.state.engine, body.model)
    a = Assistant(id=new_id("asst_"), created_at=_now(), name=body.name, description=body.description, model=model,
                  instructions=body.instructions, tools=body.tools, tool_resources=body.tool_resources,
                  meta=_meta(body.metadata), temperature=body.temperature, top_p=body.top_p,
                  response_format=body.response_format)
    with _db(request).write() as s:
        s.add(a)
    return a.to_dict()


@router.get("/assistants")
def list_assistants(request: Request, limit: Limit = 20, order: Order = "desc", after: str | None = None,
                    before: str | None = None):
    with _db(request).read() as s:
        return Database.page(s, Assistant, limit=limit, order=order, after=after, before=before)


@router.get("/assistants/{assistant_id}")
def get_assistant(assistant_id: str, request: Request):
    with _db(request).read() as s:
        return Database.get(s, Assistant, assistant_id, "assistant").to_dict()


@router.post("/assistants/{assistant_id}")
def modify_assistant(assistant_id: str, body: AssistantModify, request: Request):
    fields = body.model_dump(exclude_unset=True)
    if "model" in fields:
        fields["model"] = check_model(request.app.state.engine, fields["model"])
    with _db(request).write() as s:
        a = Database.get(s, Assistant, assistant_id, "assistant")
        for k, v in fields.items():
            setattr(a, "meta" if k == "metadata" else k, _meta(v) if k == "metadata" else v)
    return a.to_dict()


@router.delete("/assistants/{assistant_id}")
def delete_assistant(assistant_id: str, request: Request):
    with _db(request).write() as s:
        s.delete(Database.get(s, Assistant, assistant_id, "assistant"))
    return {"id": assistant_id, "object": "assistant.deleted", "deleted": True}


# ---- threads ------------------------------------------------------------------------------

def _new_message(thread_id: str, m: MessageCreate, i: int | None = None, images=None) -> Message:
    param = "content" if i is None else f"messages[{i}].content"
    return Message(id=new_id("msg_"), thread_id=thread_id, created_at=_now(), role=m.role,
                   content=_parts(m.content, param, images), status="completed", attachments=m.attachments or [],
                   meta=_meta(m.metadata), completed_at=_now())


def _create_thread(s, body: ThreadCreate | None, images=None) -> Thread:
    body = body or ThreadCreate()
    t = Thread(id=new_id("thread_"), created_at=_now(), meta=_meta(body.metadata), tool_resources=body.tool_resources)
    s.add(t)
    for i, m in enumerate(body.messages or []):
        s.add(_new_message(t.id, m, i, images))
    return t


def _images(request: Request):
    """The model's ImageSupport when it takes images (None: text only)."""
    return getattr(request.app.state.engine, "images", None)


@router.post("/threads")
def create_thread(request: Request, body: ThreadCreate | None = None):
    with _db(request).write() as s:
        t = _create_thread(s, body, _images(request))
    return t.to_dict()


# registered before the /threads/{thread_id} routes, which would otherwise match "runs" as an id
@router.post("/threads/runs", responses=STREAMS_SSE)
async def create_thread_and_run(body: ThreadAndRunCreate, request: Request):
    _check_run_body(request, body)
    db = _db(request)

    def work():
        with db.write() as s:
            Database.get(s, Assistant, body.assistant_id, "assistant")
            t = _create_thread(s, body.thread, _images(request))
            s.flush()
            return t.to_dict(), _insert_run(s, t.id, body, _images(request)).to_dict()

    thread_d, run_d = await run_in_threadpool(work)
    return await _launch(request, run_d, body.stream, thread_d if body.stream else None)


@router.get("/threads")
def list_threads(request: Request, limit: Limit = 20, order: Order = "desc", after: str | None = None,
                 before: str | None = None):
    with _db(request).read() as s:
        return Database.page(s, Thread, limit=limit, order=order, after=after, before=before)


@router.get("/threads/{thread_id}")
def get_thread(thread_id: str, request: Request):
    with _db(request).read() as s:
        return Database.get(s, Thread, thread_id, "thread").to_dict()


@router.post("/threads/{thread_id}")
def modify_thread(thread_id: str, body: MetadataModify, request: Request):
    fields = body.model_dump(exclude_unset=True)
    with _db(request).write() as s:
        t = Database.get(s, Thread, thread_id, "thread", lock=True)
        if "metadata" in fields:
            t.meta = _meta(fields["metadata"])
        if "tool_resources" in fields:
            t.tool_resources = fields["tool_resources"]
    return t.to_dict()


@router.delete("/threads/{thread_id}")
def delete_thread(thread_id: str, request: Request):
    registry: RunRegistry = request.app.state.runs
    with _db(request).write() as s:
        t = Database.get(s, Thread, thread_id, "thread", lock=True)
        for r in s.scalars(select(Run).where(Run.thread_id == thread_id, Run.status.in_(ACTIVE_RUN))):
            registry.cancel(r.id)
        s.execute(delete(Message).where(Message.thread_id == thread_id))
        s.execute(delete(Run).where(Run.thread_id == thread_id))
        s.delete(t)
    return {"id": thread_id, "object": "thread.deleted", "deleted": True}


# ---- messages -----------------------------------------------------------------------------

def _active_run(s, thread_id: str) -> Run | None:
    return s.scalar(select(Run).where(Run.thread_id == thread_id, Run.status.in_(ACTIVE_RUN)))


@router.post("/threads/{thread_id}/messages")
def create_message(thread_id: str, body: MessageCreate, request: Request):
    with _db(request).write() as s:
        Database.get(s, Thread, thread_id, "thread", lock=True)
        active = _active_run(s, thread_id)
        if active is not None:
            raise APIError(400, f"Can't add messages to {thread_id} while a run {active.id} is active.",
                           param="thread_id")
        m = _new_message(thread_id, body, images=_images(request))
        s.add(m)
    return m.to_dict()


@router.get("/threads/{thread_id}/messages")
def list_messages(thread_id: str, request: Request, limit: Limit = 20, order: Order = "desc",
                  after: str | None = None, before: str | None = None, run_id: str | None = None):
    with _db(request).read() as s:
        Database.get(s, Thread, thread_id, "thread")
        filters = [Message.thread_id == thread_id] + ([Message.run_id == run_id] if run_id else [])
        return Database.page(s, Message, *filters, limit=limit, order=order, after=after, before=before)


def _in_thread(s, cls, obj_id: str, what: str, thread_id: str, *, lock: bool = False):
    """The message or run ``obj_id`` of thread ``thread_id`` (404 when none or another thread's)."""
    row = Database.get(s, cls, obj_id, what, lock=lock)
    if row.thread_id != thread_id:
        raise APIError(404, f"No {what} found with id '{obj_id}' in thread '{thread_id}'.", param=f"{what}_id")
    return row


def _message(s, thread_id: str, message_id: str) -> Message:
    return _in_thread(s, Message, message_id, "message", thread_id)


def _modify_metadata(request: Request, find, body: RunModify) -> dict:
    """POST on a message or run: only its metadata changes (``find(session)`` reads the row)."""
    with _db(request).write() as s:
        row = find(s)
        if body.metadata is not None:
            row.meta = _meta(body.metadata)
    return row.to_dict()


@router.get("/threads/{thread_id}/messages/{message_id}")
def get_message(thread_id: str, message_id: str, request: Request):
    with _db(request).read() as s:
        return _message(s, thread_id, message_id).to_dict()


@router.post("/threads/{thread_id}/messages/{message_id}")
def modify_message(thread_id: str, message_id: str, body: RunModify, request: Request):
    return _modify_metadata(request, lambda s: _message(s, thread_id, message_id), body)


@router.delete("/threads/{thread_id}/messages/{message_id}")
def delete_message(thread_id: str, message_id: str, request: Request):
    with _db(request).write() as s:
        s.delete(_message(s, thread_id, message_id))
    return {"id": message_id, "object": "thread.message.deleted", "deleted": True}


# ---- runs ---------------------------------------------------------------------------------

@dataclass
class ActiveRun:
    run_id: str
    cancelled: bool = False
    stream: object = None  # EngineStream once submitted
    listeners: list = field(default_factory=list)  # asyncio.Queues of (event, data)
    task: asyncio.Task | None = None


class RunRegistry(JobRegistry):
    """Runs executing in this process (``ActiveRun`` by run id: their tasks, engine streams and SSE listeners)."""


def _prompt_messages(s, run: Run) -> list[dict]:
    msgs = []
    if run.instructions:
        msgs.append({"role": "system", "content": run.instructions})
    rows = s.scalars(select(Message).where(Message.thread_id == run.thread_id, Message.id != (run.message_id or ""))
                     .order_by(Message.seq.asc()))
    for m in rows:
        if m.role in ("user", "assistant") and (m.role == "user" or m.status != "in_progress"):
            msgs.append({"role": m.role, "content": list(m.content) if _has_images(m.content) else m.text()})
    return msgs


def _run_prompt(engine, messages: list[dict], max_prompt_tokens: int | None) -> list[int]:
    """Prompt ids of a run: the thread through the chat template, its pictures (``image_url``
    parts, on a model that takes images) through the model's processor."""
    support = getattr(engine, "images", None)
    if support is None or not any(isinstance(m["content"], list) for m in messages):
        ids = engine.apply_chat_template(messages)
        return ids[-max_prompt_tokens:] if max_prompt_tokens and len(ids) > max_prompt_tokens else ids
    images = support.collector()
    msgs = [dict(m, content=content_text(m["content"], f"messages[{i}].content", images))
            for i, m in enumerate(messages)]
    ids = with_images(engine, engine.apply_chat_template(msgs), images)
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        raise APIError(400, f"the thread is {len(ids)} tokens with its pictures, over max_prompt_tokens "
                            f"({max_prompt_tokens}); a prompt with pictures is not cut", param="max_prompt_tokens")
    return ids


class RunExecutor:
    """Executes one run: prompt → engine → assistant message, with DB updates and SSE events."""

    def __init__(self, app, run_id: str, active: ActiveRun):
        self.app = app
        self.db: Database = app.state.db
        self.engine: Engine = app.state.engine
        self.run_id = run_id
        self.active = active

    def publish(self, event: str, data) -> None:
        for q in self.active.listeners:
            q.put_nowait((event, data))

    async def _write(self, fn):
        def work():
            with self.db.write() as s:
                run = Database.get(s, Run, self.run_id, "run", lock=True)
                return fn(s, run), run.status == "cancelling"
        out, cancelling = await run_in_threadpool(work)
        if cancelling and not self.active.cancelled:  # cancelled through another server sharing the database
            self.app.state.runs.cancel(self.run_id)
        return out

    async def execute(self) -> None:
        try:
            await self._execute()
        except Exception as e:  # noqa: BLE001 - any failure ends the run as failed, not the server
            log.exception("run %s failed", self.run_id)
            err = {"code": "server_error", "message": f"{type(e).__name__}: {e}"}
            if isinstance(e, APIError):
                code = {503: "rate_limit_exceeded", 400: "invalid_prompt"}.get(e.status, "server_error")
                err = {"code": code, "message": e.message}
            with contextlib.suppress(Exception):
                await self._finish("failed", err=err)
        finally:
            self.publish("done", "[DONE]")
            self.publish(None, None)
            self.app.state.runs.active.pop(self.run_id, None)

    async def _execute(self) -> None:
        # wait for the engine to take the request (a background run waits out a full queue)
        def prepare(s, run):
            return _prompt_messages(s, run), run.to_dict()

        messages, run_d = await self._write(prepare)
        ids = await run_in_threadpool(_run_prompt, self.engine, messages, run_d["max_prompt_tokens"])
        req = GenerationRequest(ids, temperature=run_d["temperature"], top_p=run_d["top_p"],
                                max_new_tokens=run_d["max_completion_tokens"], tag="assistants.run")
        while True:
            if self.active.cancelled:
                await self._finish("cancelled")
                return
            try:
                stream = await self.engine.submit(req)
                break
            except QueueFull:
                await asyncio.sleep(0.5)
        self.active.stream = stream
        if self.active.cancelled:
            stream.cancel()

        def start(s, run):
            now = _now()
            run.status = "in_progress" if run.status == "queued" else run.status
            run.started_at = now
            m = Message(id=new_id("msg_"), thread_id=run.thread_id, created_at=now, role="assistant",
                        content=[], status="in_progress", assistant_id=run.assistant_id, run_id=run.id)
            s.add(m)
            run.message_id = m.id
            return run.to_dict(), run.step_dict(), m.to_dict()

        run_d, step_d, msg_d = await self._write(start)
        self.publish("thread.run.in_progress", run_d)
        self.publish("thread.run.step.created", step_d)
        self.publish("thread.run.step.in_progress", step_d)
        self.publish("thread.message.created", msg_d)
        self.publish("thread.message.in_progress", msg_d)

        got = Collected()
        last_save = time.monotonic()
        async for _, val in pieces(stream, got):
            self.publish("thread.message.delta", {
                "id": msg_d["id"], "object": "thread.message.delta",
                "delta": {"content": [{"index": 0, "type": "text", "text": {"value": val, "annotations": []}}]}})
            if time.monotonic() - last_save > _SAVE_EVERY_S:  # partial answers survive a crash
                last_save = time.monotonic()

                def save(s, run, partial=got.text):
                    m = Database.get(s, Message, run.message_id, "message")
                    m.content = [{"type": "text", "text": {"value": partial, "annotations": []}}]
                await self._write(save)
        n_out = len(got.token_ids)
        usage = {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}
        status = {"cancelled": "cancelled", "length": "incomplete"}.get(got.finish_reason, "completed")
        if self.active.cancelled:
            status = "cancelled"
        await self._finish(status, text=got.text, usage=usage)

    async def _finish(self, status: str, *, text: str | None = None, usage: dict | None = None,
                      err: dict | None = None) -> None:
        def finish(s, run):
            nonlocal status
            if run.status == "cancelling" and status != "failed":  # asked through another server meanwhile
                status = "cancelled"
            now = _now()
            run.status = status
            run.usage = usage or run.usage
            if status == "completed":
                run.completed_at = now
            elif status == "cancelled":
                run.cancelled_at = now
            elif status == "failed":
                run.failed_at, run.last_error = now, err
            elif status == "incomplete":
                run.completed_at = now
                run.incomplete_details = {"reason": "max_completion_tokens"}
            msg = None
            if run.message_id:
                m = Database.get(s, Message, run.message_id, "message")
                if text is not None:
                    m.content = [{"type": "text", "text": {"value": text, "annotations": []}}]
                if status == "completed":
                    m.status, m.completed_at = "completed", now
                else:
                    m.status, m.incomplete_at = "incomplete", now
                    m.incomplete_details = {"reason": {"cancelled": "run_cancelled", "failed": "run_failed",
                                                       "incomplete": "max_tokens"}[status]}
                msg = m.to_dict()
            return run.to_dict(), run.step_dict(), msg

        run_d, step_d, msg_d = await self._write(finish)
        if msg_d is not None:
            self.publish("thread.message.completed" if status == "completed" else "thread.message.incomplete", msg_d)
            self.publish({"completed": "thread.run.step.completed", "incomplete": "thread.run.step.completed",
                          "cancelled": "thread.run.step.cancelled", "failed": "thread.run.step.failed"}[status],
                         step_d)
        self.publish(f"thread.run.{status}", run_d)


def _check_run_body(request: Request, body: RunCreate) -> None:
    if body.tools:
        raise APIError(400, "tools in Assistants runs are not supported by this server yet", param="tools")
    if body.model:
        check_model(request.app.state.engine, body.model)


def _insert_run(s, thread_id: str, body: RunCreate, images=None) -> Run:
    a = Database.get(s, Assistant, body.assistant_id, "assistant")
    active = _active_run(s, thread_id)
    if active is not None:
        raise APIError(400, f"Thread {thread_id} already has an active run {active.id}.", param="thread_id")
    for i, m in enumerate(body.additional_messages or []):
        s.add(_new_message(thread_id, m, i, images))
    instructions = body.instructions if body.instructions is not None else (a.instructions or "")
    if body.additional_instructions:
        instructions = (instructions + "\n\n" + body.additional_instructions).strip()
    run = Run(id=new_id("run_"), thread_id=thread_id, assistant_id=a.id, created_at=_now(), status="queued",
              model=a.model, instructions=instructions, tools=[], meta=_meta(body.metadata),
              temperature=body.temperature if body.temperature is not None else a.temperature,
              top_p=body.top_p if body.top_p is not None else a.top_p,
              max_prompt_tokens=body.max_prompt_tokens, max_completion_tokens=body.max_completion_tokens,
              truncation_strategy=body.truncation_strategy, tool_choice=body.tool_choice,
              response_format=body.response_format,
              parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls)
    s.add(run)
    return run


async def _launch(request: Request, run_d: dict, stream: bool, thread_d: dict | None = None):
    app = request.app
    registry: RunRegistry = app.state.runs
    active = ActiveRun(run_d["id"])
    q: asyncio.Queue | None = asyncio.Queue() if stream else None
    if q is not None:
        active.listeners.append(q)
        if thread_d is not None:
            q.put_nowait(("thread.created", thread_d))
        q.put_nowait(("thread.run.created", run_d))
        q.put_nowait(("thread.run.queued", run_d))
    registry.active[run_d["id"]] = active
    active.task = asyncio.create_task(RunExecutor(app, run_d["id"], active).execute())
    if q is None:
        return run_d

    async def events():
        finished = False
        try:
            while True:
                event, data = await q.get()
                if event is None:
                    finished = True
                    return
                yield sse(data, event)
        finally:
            if not finished:  # the client went away: stop generating for it
                registry.cancel(run_d["id"])

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/threads/{thread_id}/runs", responses=STREAMS_SSE)
async def create_run(thread_id: str, body: RunCreate, request: Request):
    _check_run_body(request, body)
    run_d = await run_in_threadpool(start_run, _db(request), thread_id, body, _images(request))
    return await _launch(request, run_d, body.stream)


def start_run(db: Database, thread_id: str, body: RunCreate, images=None) -> dict:
    """Write a queued run on ``thread_id``; the thread's row lock keeps it the only active run even
    when several servers share the database."""
    with db.write() as s:
        Database.get(s, Thread, thread_id, "thread", lock=True)
        return _insert_run(s, thread_id, body, images).to_dict()


def _run(s, thread_id: str, run_id: str, *, lock: bool = False) -> Run:
    return _in_thread(s, Run, run_id, "run", thread_id, lock=lock)


@router.get("/threads/{thread_id}/runs")
def list_runs(thread_id: str, request: Request, limit: Limit = 20, order: Order = "desc", after: str | None = None,
              before: str | None = None):
    with _db(request).read() as s:
        Database.get(s, Thread, thread_id, "thread")
        return Database.page(s, Run, Run.thread_id == thread_id, limit=limit, order=order, after=after,
                             before=before)


@router.get("/threads/{thread_id}/runs/{run_id}")
def get_run(thread_id: str, run_id: str, request: Request):
    with _db(request).read() as s:
        return _run(s, thread_id, run_id).to_dict()


@router.post("/threads/{thread_id}/runs/{run_id}")
def modify_run(thread_id: str, run_id: str, body: RunModify, request: Request):
    return _modify_metadata(request, lambda s: _run(s, thread_id, run_id), body)


@router.post("/threads/{thread_id}/runs/{run_id}/cancel")
def cancel_run(thread_id: str, run_id: str, request: Request):
    registry: RunRegistry = request.app.state.runs
    with _db(request).write() as s:
        r = _run(s, thread_id, run_id, lock=True)
        if r.status not in ACTIVE_RUN:
            raise APIError(400, f"Cannot cancel run with status '{r.status}'.", param="run_id")
        if registry.cancel(run_id):
            r.status = "cancelling"
        elif not _db(request).owner_is_gone(s, r.owner):  # another live server executes it: it sees this and stops
            r.status = "cancelling"
        else:  # nobody executes it any more
            r.status, r.cancelled_at = "cancelled", _now()
    return r.to_dict()


@router.post("/threads/{thread_id}/runs/{run_id}/submit_tool_outputs")
def submit_tool_outputs(thread_id: str, run_id: str, request: Request):
    with _db(request).read() as s:
        r = _run(s, thread_id, run_id)
    raise APIError(400, f"Run {r.id} is not waiting for tool outputs (status '{r.status}').", param="run_id")


@router.get("/threads/{thread_id}/runs/{run_id}/steps")
def list_run_steps(thread_id: str, run_id: str, request: Request, limit: Limit = 20,
                   order: Order = "desc"):
    with _db(request).read() as s:
        r = _run(s, thread_id, run_id)
        data = [r.step_dict()] if r.message_id else []
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": False}


@router.get("/threads/{thread_id}/runs/{run_id}/steps/{step_id}")
def get_run_step(thread_id: str, run_id: str, step_id: str, request: Request):
    with _db(request).read() as s:
        r = _run(s, thread_id, run_id)
        if not r.message_id or step_id != "step_" + r.id[4:]:
            raise APIError(404, f"No run step found with id '{step_id}'.", param="step_id")
        return r.step_dict()
