"""Helpers the API modules share: model-name checks, the one loop that drains an engine stream
(:func:`pieces`), running it to the end while watching for a client that went away, ending a
streamed body with an error event instead of a dropped connection, SSE/NDJSON framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request

from .engine import Engine, EngineStream
from .errors import APIError, internal_error

log = logging.getLogger("ktransformers.server")


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def check_model(engine: Engine, name: str | None, *, ollama: bool = False) -> str:
    """The served model's name; 404 for any other non-empty name."""
    if not name:
        if ollama:
            raise APIError(400, "'model' is required", param="model")
        return engine.model_name
    base = name[:-len(":latest")] if name.endswith(":latest") else name
    served = engine.model_name
    served_base = served[:-len(":latest")] if served.endswith(":latest") else served
    if base != served_base:
        msg = (f"model '{name}' not found" if ollama
               else f"The model '{name}' does not exist; this server serves '{served}'")
        raise APIError(404, msg, param="model", code="model_not_found")
    return served


def stop_list(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop if s]


@dataclass
class Collected:
    """What a drained stream produced so far (filled in by :func:`pieces`)."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def pieces(stream: EngineStream, got: Collected, parser=None):
    """The one loop over an engine stream: records ids, text and the finish reason in ``got`` and
    yields ``("text", str)`` items, or with a ``parser`` (:class:`~.prompting.OutputParser`) its
    ``("reasoning" | "text" | "call", value)`` items (the held-back rest when the stream ends)."""
    async for ev in stream:
        if ev.token_id is not None:
            got.token_ids.append(ev.token_id)
        if ev.finish_reason:
            got.finish_reason = ev.finish_reason
        if ev.text:
            got.parts.append(ev.text)
            if parser is None:
                yield "text", ev.text
            else:
                for item in parser.feed(ev.text):
                    yield item
    if parser is not None:
        for item in parser.finish():
            yield item


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request | None, stream: EngineStream):
    """While the body runs, a client disconnect cancels ``stream`` at once."""

    async def watch():
        try:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    stream.cancel()
                    return
        except Exception:
            return

    task = asyncio.create_task(watch()) if request is not None else None
    try:
        yield
    except BaseException:
        stream.cancel()
        raise
    finally:
        if task is not None:
            task.cancel()


class JobRegistry:
    """Generations running in this process (assistant runs, responses) by id, for ``cancel``.
    Each job has ``cancelled``, ``stream`` (its EngineStream once submitted) and ``task``."""

    def __init__(self):
        self.active: dict = {}

    def cancel(self, job_id: str) -> bool:
        job = self.active.get(job_id)
        if job is None:
            return False
        job.cancelled = True
        if job.stream is not None:
            job.stream.cancel()
        return True

    async def shutdown(self) -> None:
        tasks = [j.task for j in self.active.values() if j.task is not None]
        for job_id in list(self.active):
            self.cancel(job_id)
        if tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait(tasks, timeout=5)


async def collect(stream: EngineStream, request: Request | None = None) -> Collected:
    out = Collected()
    async with cancel_on_disconnect(request, stream):
        async for _ in pieces(stream, out):
            pass
    return out


async def guarded(agen, request: Request, error_chunks, cancel):
    """A streaming body that always ends well-formed and always stops its generation.

    An ``APIError`` (or, logged with its traceback, any other exception) after the response has
    started becomes the API's own error event(s) from ``error_chunks(err)``; however the body
    ends (finished, client gone, error), ``cancel()`` stops the generation."""
    try:
        async for chunk in agen:
            yield chunk
    except APIError as e:
        for c in error_chunks(e):
            yield c
    except Exception:
        err = internal_error(request)
        log.exception("streamed response failed (request id %s)", err.request_id)
        for c in error_chunks(err):
            yield c
    finally:
        cancel()
        with contextlib.suppress(Exception):
            await agen.aclose()


def sse(obj, event: str | None = None) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


def ndjson(obj) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stats_numbers(stream: EngineStream, generated: int) -> dict:
    """prompt/eval counts and durations from the Generator's stats, else wall-clock.  The prompt
    count is what was evaluated: prompt tokens reused from the prefix cache are not."""
    st = stream.stats
    if st is not None:
        prompt_n, prompt_s = st.prompt_tokens - st.cached_tokens, st.prefill_seconds
        gen_n, gen_s = st.generated_tokens, st.decode_seconds
    else:
        prompt_n, prompt_s, gen_n, gen_s = stream.prompt_tokens, 0.0, generated, 0.0
    return {"prompt_tokens": int(prompt_n), "prompt_seconds": float(prompt_s),
            "generated_tokens": int(gen_n), "decode_seconds": float(gen_s)}
