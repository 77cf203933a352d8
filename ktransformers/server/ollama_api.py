"""Ollama-compatible routes under ``/api``: generate, chat, tags, show, ps, pull, version (embed,
embeddings: ``embeddings_api.py``).

``stream`` defaults to true as in Ollama: NDJSON lines, the last one with ``done: true`` and
the timing fields (nanoseconds) from the Generator's stats.  ``stream: false`` answers one
JSON object.  ``load_duration`` reports the time the request waited for the engine (the model
itself is loaded once, at server start).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .common import Collected, check_model, collect, guarded, ndjson, pieces, stats_numbers, stop_list
from .engine import Engine, EngineStream, GenerationRequest
from .errors import STREAMS_NDJSON, APIError
from .prompting import fim_prompt, fim_tokens, render_go_template
from .schemas import (UNTIL_LIMIT, OllamaChatRequest, OllamaGenerateRequest, OllamaOptions, OllamaPullRequest,
                      OllamaShowRequest)

router = APIRouter()

#: the Ollama API version these routes follow (clients check it before using newer fields)
OLLAMA_COMPAT_VERSION = "0.6.0"


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _ts(t: float | None = None) -> str:
    d = datetime.now(timezone.utc) if t is None else datetime.fromtimestamp(t, timezone.utc)
    return d.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def _request(engine: Engine, ids: list[int], options: OllamaOptions | None, tag: str) -> GenerationRequest:
    o = options or OllamaOptions()
    # -1 (until the model stops) and -2 (fill the context) take the server's limit (--max_new_tokens),
    # capped to the room the prompt leaves, as a request without num_predict does
    max_new = None if o.num_predict in UNTIL_LIMIT else o.num_predict
    return GenerationRequest(ids, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, max_new_tokens=max_new,
                             stop=stop_list(o.stop), seed=o.seed, repetition_penalty=o.repeat_penalty, tag=tag)


def _done_fields(stream: EngineStream, generated: int, reason: str | None) -> dict:
    s = stats_numbers(stream, generated)
    return {
        "done_reason": "length" if reason == "length" else "stop",
        "total_duration": _ns(stream.total_seconds),
        "load_duration": _ns(stream.queue_seconds),
        "prompt_eval_count": s["prompt_tokens"],
        "prompt_eval_duration": _ns(s["prompt_seconds"]),
        "eval_count": s["generated_tokens"],
        "eval_duration": _ns(s["decode_seconds"]),
    }


def _load_reply(model: str, chat: bool) -> dict:
    out = {"model": model, "created_at": _ts(), "done": True, "done_reason": "load"}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return out


def _generate_prompt(request: Request, body: OllamaGenerateRequest):
    """The prompt of ``/api/generate``: a ChatPrompt through the chat template (reasoning read
    from the answer), else the raw / Go-template / fill-in-the-middle text (nothing read)."""
    from .openai_api import request_prompt
    from .prompting import ChatPrompt

    engine = _engine(request)
    prompt = body.prompt or ""
    context = engine.check_token_ids(body.context or [], "context")
    special = not context  # a continuation of a context gets no second BOS
    if body.images and (body.template or body.suffix or body.raw):
        raise APIError(400, "images go through the model's chat template: not with raw, template or suffix",
                       param="images")
    if body.template:
        text = render_go_template(body.template, {"System": body.system or "", "Prompt": prompt,
                                                  "Suffix": body.suffix or ""})
        return ChatPrompt(context + engine.encode(text, special)), False
    if body.suffix:
        text, _ = fim_prompt(engine.tokenizer, prompt, body.suffix)
        return ChatPrompt(context + engine.encode(text, special)), False
    if body.raw:
        return ChatPrompt(context + engine.encode(prompt, special)), False
    msgs = ([{"role": "system", "content": body.system}] if body.system else []) + \
           [{"role": "user", "content": with_ollama_images(prompt, body.images)}]
    if context and body.images:
        raise APIError(400, "images with a context: send the conversation to /api/chat instead", param="context")
    p = request_prompt(request.app, msgs, None, think=body.think)
    p.ids = context + p.ids if context else p.ids
    return p, True


def with_ollama_images(content: str, images: list[str] | None, where: str = "images"):
    """A message's text and its base64 ``images`` as content parts (images first, as Ollama puts them)."""
    if not images:
        return content
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise APIError(400, f"'{where}' must be a list of base64 strings", param=where)
    return [{"type": "image", "data": i} for i in images] + [{"type": "text", "text": content}]


@router.post("/generate", responses=STREAMS_NDJSON)
async def generate(body: OllamaGenerateRequest, request: Request):
    engine = _engine(request)
    model = check_model(engine, body.model, ollama=True)
    if not (body.prompt or body.suffix):
        return _load_reply(model, chat=False)
    prompt, templated = await run_in_threadpool(_generate_prompt, request, body)
    ids = prompt.ids
    if not ids:  # a template or raw text that renders to nothing: as an empty prompt
        return _load_reply(model, chat=False)
    stream = await engine.submit(_request(engine, ids, body.options, "ollama.generate"))
    with_context = not body.raw

    if not body.stream:
        got = await collect(stream, request)
        thinking, text, _ = prompt.parser(False).parse(got.text) if templated else (None, got.text, [])
        out = {"model": model, "created_at": _ts(), "response": text, "done": True,
               **_done_fields(stream, len(got.token_ids), got.finish_reason)}
        if thinking is not None:
            out["thinking"] = thinking
        if with_context:
            out["context"] = ids + got.token_ids
        return out

    async def lines():
        got = Collected()
        async for kind, val in pieces(stream, got, prompt.parser(False) if templated else None):
            key = "thinking" if kind == "reasoning" else "response"
            yield ndjson({"model": model, "created_at": _ts(), "response": "", key: val, "done": False})
        last = {"model": model, "created_at": _ts(), "response": "", "done": True,
                **_done_fields(stream, len(got.token_ids), got.finish_reason)}
        if with_context:
            last["context"] = ids + got.token_ids
        yield ndjson(last)

    return StreamingResponse(guarded(lines(), request, _ndjson_error, stream.cancel),
                             media_type="application/x-ndjson")


def _ndjson_error(e: APIError) -> list[str]:
    """An error after the stream started: Ollama's ``{"error": ...}`` line ends it."""
    return [ndjson({"error": e.message})]


def _ollama_calls(calls: list[dict]) -> list[dict]:
    out = []
    for c in calls:
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
        except (TypeError, json.JSONDecodeError):
            args = fn["arguments"]
        out.append({"function": {"name": fn["name"], "arguments": args}})
    return out


def _chat_prompt(request: Request, body: OllamaChatRequest, tools: list[dict] | None):
    from .openai_api import request_prompt

    messages = []
    for i, m in enumerate(body.messages):
        messages.append({"role": m.role, "content": with_ollama_images(m.content or "", m.images,
                                                                        f"messages[{i}].images"),
                         "tool_calls": m.tool_calls})
    return request_prompt(request.app, messages, tools, think=body.think)


@router.post("/chat", responses=STREAMS_NDJSON)
async def chat(body: OllamaChatRequest, request: Request):
    engine = _engine(request)
    model = check_model(engine, body.model, ollama=True)
    if not body.messages:
        return _load_reply(model, chat=True)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    prompt = await run_in_threadpool(_chat_prompt, request, body, tools)
    stream = await engine.submit(_request(engine, prompt.ids, body.options, "ollama.chat"))

    if not body.stream:
        got = await collect(stream, request)
        thinking, content, calls = prompt.parser(bool(tools)).parse(got.text)
        msg = {"role": "assistant", "content": content}
        if thinking is not None:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = _ollama_calls(calls)
        return {"model": model, "created_at": _ts(), "message": msg, "done": True,
                **_done_fields(stream, len(got.token_ids), got.finish_reason)}

    async def lines():
        got = Collected()
        async for kind, val in pieces(stream, got, prompt.parser(bool(tools))):
            msg = {"role": "assistant", "content": val if kind == "text" else ""}
            if kind == "reasoning":
                msg["thinking"] = val
            if kind == "call":
                msg["tool_calls"] = _ollama_calls([val])
            yield ndjson({"model": model, "created_at": _ts(), "message": msg, "done": False})
        yield ndjson({"model": model, "created_at": _ts(), "message": {"role": "assistant", "content": ""},
                      "done": True, **_done_fields(stream, len(got.token_ids), got.finish_reason)})

    return StreamingResponse(guarded(lines(), request, _ndjson_error, stream.cancel),
                             media_type="application/x-ndjson")


# ---- model information -------------------------------------------------------------------

def _details(engine: Engine) -> dict:
    info = engine.model_info
    family = info.get("family", "")
    return {"parent_model": "", "format": info.get("format", ""), "family": family,
            "families": [family] if family else None,
            "parameter_size": info.get("parameter_size", ""), "quantization_level": info.get("quantization", "")}


def _digest(engine: Engine) -> str:
    key = f"{engine.model_name}:{engine.model_info.get('path', '')}:{engine.model_info.get('size', 0)}"
    return hashlib.sha256(key.encode()).hexdigest()


def _entry(engine: Engine) -> dict:
    return {"name": engine.model_name, "model": engine.model_name, "modified_at": _ts(engine.loaded_at),
            "size": int(engine.model_info.get("size", 0)), "digest": _digest(engine), "details": _details(engine)}


@router.get("/tags")
async def tags(request: Request):
    return {"models": [_entry(_engine(request))]}


@router.get("/ps")
async def ps(request: Request):
    e = _engine(request)
    entry = _entry(e)
    entry.pop("modified_at")
    entry["expires_at"] = _ts((datetime.now(timezone.utc) + timedelta(days=3650)).timestamp())
    entry["size_vram"] = int(e.model_info.get("size_vram", 0))
    entry["context_length"] = e.max_context
    return {"models": [entry]}


@router.post("/pull", responses=STREAMS_NDJSON)
async def pull(body: OllamaPullRequest, request: Request):
    """Nothing to download: the served model is there (``success``); any other name is a 400 that says
    why, where Ollama would fetch it."""
    e = _engine(request)
    names = [n for n in (body.model, body.name) if n is not None] or [None]
    for name in names:
        try:
            check_model(e, name, ollama=True)
        except APIError as err:
            if not name:
                raise
            raise APIError(400, f"this server loads one model from a path at start (--gguf_path / --model_path) "
                                f"and cannot pull '{name}'; it serves '{e.model_name}'", param="model") from err
    done = {"status": "success"}
    if not body.stream:
        return done
    return StreamingResponse(iter([ndjson(done)]), media_type="application/x-ndjson")


@router.get("/version")
async def version():
    from .. import __version__

    return {"version": OLLAMA_COMPAT_VERSION, "server": f"ktransformers {__version__}"}


@router.post("/show")
async def show(body: OllamaShowRequest, request: Request):
    e = _engine(request)
    check_model(e, body.model or body.name, ollama=True)
    d = e.defaults
    params = [f"temperature {d.temperature}", f"top_p {d.top_p}", f"top_k {d.top_k}",
              f"num_predict {d.max_new_tokens}", f"num_ctx {e.max_context}"]
    caps = ["completion", "tools"]
    if fim_tokens(e.tokenizer) is not None:
        caps.append("insert")
    if getattr(e, "images", None) is not None:  # a vision-language model: messages may carry images
        caps.append("vision")
    family = e.model_info.get("family", "")
    model_info = {"general.architecture": family, "general.name": e.model_name,
                  "general.parameter_count": int(e.model_info.get("parameter_count", 0)),
                  f"{family or 'model'}.context_length": e.max_context}
    return JSONResponse({
        "license": "",
        "modelfile": f"# served by ktransformers\nFROM {e.model_name}\n",  # no server paths in answers
        "parameters": "\n".join(params),
        "template": e.chat_template or "{{ .Prompt }}",
        "details": _details(e),
        "model_info": model_info,
        "capabilities": caps,
        "modified_at": _ts(e.loaded_at),
    })
