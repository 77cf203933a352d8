"""OpenAI-compatible routes under ``/v1``: models, chat completions, (legacy) completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from .common import SSE_HEADERS, Collected, check_model, collect, guarded, new_id, now, pieces, sse, stop_list
from .engine import Engine, GenerationRequest
from .errors import STREAMS_SSE, APIError, error_body
from .prompting import chat_prompt, fim_prompt, think_setting
from .schemas import (ChatChoice, ChatCompletion, ChatCompletionRequest, Completion, CompletionChoice,
                      CompletionRequest, ModelCard, ModelList, ResponseMessage, Usage)

router = APIRouter()


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _unsupported(body) -> None:
    if body.n is not None and body.n > 1:
        raise APIError(400, "n > 1 is not supported: this server returns one choice per request", param="n")
    if getattr(body, "logprobs", None):
        raise APIError(400, "logprobs are not supported by this server", param="logprobs")
    if getattr(body, "best_of", None) not in (None, 1):
        raise APIError(400, "best_of > 1 is not supported by this server", param="best_of")
    refuse_structured_output(getattr(body, "response_format", None), "response_format")


def refuse_structured_output(fmt, param: str) -> None:
    """JSON-mode / JSON-schema output needs constrained decoding, which this server does not have:
    a 400, rather than free text the client would take for valid JSON. Plain text passes."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in (None, "text"):
        raise APIError(400, f"{param} type '{kind}' is not supported: this server has no constrained "
                            f"(JSON) decoding; ask for JSON in the prompt instead", param=param)


@router.get("/models", response_model=ModelList)
async def list_models(request: Request):
    e = _engine(request)
    return ModelList(data=[ModelCard(id=e.model_name, created=int(e.loaded_at))])


@router.get("/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request):
    e = _engine(request)
    check_model(e, model_id)
    return ModelCard(id=e.model_name, created=int(e.loaded_at))


# ---- chat ---------------------------------------------------------------------------------

def request_prompt(app, messages: list[dict], tools: list[dict] | None, tool_choice=None, *,
                   effort: str | None = None, think=None, template_kwargs: dict | None = None):
    """The :class:`~.prompting.ChatPrompt` of a chat request, with the server's ``--force_think``."""
    settings = getattr(app.state, "settings", None)
    want = think_setting(effort, think, template_kwargs)
    return chat_prompt(app.state.engine, messages, tools, tool_choice, think=want, effort=effort,
                       template_kwargs=template_kwargs, force_think=bool(getattr(settings, "force_think", False)))


@router.post("/chat/completions", responses=STREAMS_SSE)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    engine = _engine(request)
    model = check_model(engine, body.model)
    _unsupported(body)
    use_tools = bool(body.tools) and body.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if use_tools else None
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt = await run_in_threadpool(request_prompt, request.app, messages, tools, body.tool_choice,
                                     effort=body.reasoning_effort, template_kwargs=body.chat_template_kwargs)
    ids = prompt.ids
    req = GenerationRequest(
        ids, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        max_new_tokens=body.max_completion_tokens or body.max_tokens, stop=stop_list(body.stop),
        seed=body.seed, repetition_penalty=body.repetition_penalty, tag="openai.chat")
    stream = await engine.submit(req)
    cid, created = new_id("chatcmpl-"), now()

    if not body.stream:
        got = await collect(stream, request)
        reasoning, content, calls = prompt.parser(use_tools).parse(got.text)  # <think> → reasoning_content
        n_out = len(got.token_ids)
        return ChatCompletion(
            id=cid, created=created, model=model,
            choices=[ChatChoice(message=ResponseMessage(content=content if (content or not calls) else None,
                                                        reasoning_content=reasoning, tool_calls=calls or None),
                                finish_reason="tool_calls" if calls else _finish(got.finish_reason))],
            usage=Usage(prompt_tokens=len(ids), completion_tokens=n_out, total_tokens=len(ids) + n_out,
                        prompt_tokens_details={"cached_tokens": stream.cached_tokens}),
        ).model_dump(exclude_none=False)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict, finish: str | None = None) -> str:
        d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": None,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            d["usage"] = None
        return sse(d)

    async def events():
        yield chunk({"role": "assistant", "content": ""})
        got = Collected()
        n_calls = 0
        async for kind, val in pieces(stream, got, prompt.parser(use_tools)):
            if kind in ("text", "reasoning"):
                if val:
                    yield chunk({"content" if kind == "text" else "reasoning_content": val})
            else:
                yield chunk({"tool_calls": [{"index": n_calls, **val}]})
                n_calls += 1
        n_out = len(got.token_ids)
        yield chunk({}, "tool_calls" if n_calls else _finish(got.finish_reason))
        if include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "system_fingerprint": None, "choices": [],
                       "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out,
                                 "total_tokens": len(ids) + n_out,
                                 "prompt_tokens_details": {"cached_tokens": stream.cached_tokens}}})
        yield sse("[DONE]")

    return StreamingResponse(guarded(events(), request, _sse_error, stream.cancel), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def _sse_error(e: APIError) -> list[str]:
    """An error after the stream started: one OpenAI-shaped error event, then the end marker."""
    return [sse(error_body("/v1", e.status, e.message, e.type, e.param, e.code)), sse("[DONE]")]


# ---- completions --------------------------------------------------------------------------

def _prompts(engine: Engine, body: CompletionRequest) -> list[tuple[str, list[int]]]:
    """[(prompt text for echo, token ids)] for each prompt in the request."""
    p = body.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [list(p)]
    else:
        items = list(p)
    out = []
    for item in items:
        if isinstance(item, str):
            text = item
            if body.suffix:
                text, _ = fim_prompt(engine.tokenizer, item, body.suffix)
            out.append((item, engine.encode(text)))
        else:
            ids = engine.check_token_ids(item, "prompt")
            out.append((engine.decode(ids), ids))
    return out


@router.post("/completions", responses=STREAMS_SSE)
async def completions(body: CompletionRequest, request: Request):
    engine = _engine(request)
    model = check_model(engine, body.model)
    _unsupported(body)
    prompts = await run_in_threadpool(_prompts, engine, body)

    def make_req(ids):
        return GenerationRequest(ids, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                 max_new_tokens=body.max_tokens,
                                 stop=stop_list(body.stop), seed=body.seed,
                                 repetition_penalty=body.repetition_penalty, tag="openai.completions")

    reqs = [make_req(ids) for _, ids in prompts]
    for r in reqs:  # every prompt is checked (length, limits) before any is generated
        engine.make_params(r)
    cid, created = new_id("cmpl-"), now()
    n_prompt = sum(len(r.input_ids) for r in reqs)

    if not body.stream:
        choices, n_out, n_cached = [], 0, 0
        for i, ((text, _), r) in enumerate(zip(prompts, reqs)):
            stream = await engine.submit(r)
            got = await collect(stream, request)
            n_out += len(got.token_ids)
            n_cached += stream.cached_tokens
            choices.append(CompletionChoice(index=i, text=(text if body.echo else "") + got.text,
                                            finish_reason=_finish(got.finish_reason)))
        return Completion(id=cid, created=created, model=model, choices=choices,
                          usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                                      prompt_tokens_details={"cached_tokens": n_cached})).model_dump()

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    first = await engine.submit(reqs[0])  # a full queue answers 503 before the stream starts

    def chunk(i: int, text: str, finish: str | None = None) -> str:
        d = {"id": cid, "object": "text_completion", "created": created, "model": model,
             "system_fingerprint": None,
             "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            d["usage"] = None
        return sse(d)

    current = {"stream": first}

    async def events():
        n_out = n_cached = 0
        for i, ((text, _), r) in enumerate(zip(prompts, reqs)):
            stream = first if i == 0 else await engine.submit(r)
            current["stream"] = stream
            if body.echo:
                yield chunk(i, text)
            got = Collected()
            async for _, val in pieces(stream, got):
                yield chunk(i, val)
            n_out += len(got.token_ids)
            n_cached += stream.cached_tokens
            yield chunk(i, "", _finish(got.finish_reason))
        if include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                "total_tokens": n_prompt + n_out,
                                                "prompt_tokens_details": {"cached_tokens": n_cached}}})
        yield sse("[DONE]")

    return StreamingResponse(guarded(events(), request, _sse_error, lambda: current["stream"].cancel()),
                             media_type="text/event-stream", headers=SSE_HEADERS)
