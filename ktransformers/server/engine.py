"""The engine boundary: one object owns the model + Generator and serves requests one at a time.

``await engine.submit(request)`` puts a request on a bounded queue and returns an
:class:`EngineStream`, an async iterator of ``TokenEvent``s.  A single worker thread runs the
generations in order, so the event loop never blocks on the model.  A full queue raises
:class:`QueueFull` at once (the HTTP layer answers 503 with ``Retry-After``); cancelling a
stream (client gone, stop button) sets the generation's cancel Event so the worker stops at
the next token and moves on.

The batching engine (batch_engine.py) keeps this interface and replaces the worker loop.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import KTError
from .errors import APIError

log = logging.getLogger("ktransformers.server")

_END = object()


class QueueFull(APIError):
    def __init__(self, retry_after: int, waiting: int):
        super().__init__(503, f"server busy: {waiting} requests already waiting; retry in {retry_after}s",
                         type="server_overloaded", code="queue_full", headers={"Retry-After": str(retry_after)})


class PromptTooLong(APIError):
    """``model_limit``: the model's own context (max_position_embeddings); a larger --cache_lens is
    suggested only below it."""

    def __init__(self, n: int, limit: int, max_new: int | None = None, model_limit: int | None = None):
        at_model = model_limit is not None and limit >= model_limit
        why = "the model's own limit, max_position_embeddings" if at_model else "--cache_lens"
        if max_new is None:
            fix = "shorten the prompt" + ("" if at_model else " or restart with a larger --cache_lens")
            msg = f"prompt is {n} tokens but this server's context holds {limit} tokens ({why}); {fix}"
        else:
            msg = (f"prompt of {n} tokens + {max_new} max tokens is {n + max_new} tokens but this server's context "
                   f"holds {limit} tokens ({why}); ask for at most {limit - n} tokens")
        super().__init__(400, msg, code="context_length_exceeded",
                         param="messages" if max_new is None else "max_tokens")


#: request seeds are taken modulo this: the seeds a torch.Generator takes (negative ones as it wraps them)
SEED_MODULUS = 2**64

#: temperatures below this sample as greedy: it is their limit, and dividing logits by less overflows
MIN_TEMPERATURE = 1e-4


def _check_unicode(text, param: str) -> None:
    """A 400 for text that is not valid Unicode (a lone surrogate), wherever it came from."""
    from .schemas import lone_surrogate

    bad = lone_surrogate(text, param)
    if bad:
        raise APIError(400, f"{bad} is not valid Unicode", param=param)


def text_chars(value) -> int:
    """Characters in the strings of a JSON value (the text a chat template renders from it)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


@dataclass
class SamplingDefaults:
    """Server-wide sampling defaults; a request's own values win when present."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    repetition_penalty: float = 1.0


@dataclass
class GenerationRequest:
    input_ids: list[int]
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    repetition_penalty: float | None = None
    tag: str = ""  # what the request came from, for logs and /health


class EngineStream:
    """Async iterator over one request's TokenEvents; the last one carries ``finish_reason``."""

    def __init__(self, job: "_Job"):
        self._job = job

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._job.events.get()
        if item is _END:
            self._job.events.put_nowait(_END)  # keep answering StopAsyncIteration
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        """Stop this generation at the next token (or drop it from the queue)."""
        self._job.cancel.set()

    @property
    def id(self) -> int:
        return self._job.id

    @property
    def prompt_tokens(self) -> int:
        return len(self._job.request.input_ids)

    @property
    def params(self):
        return self._job.params

    @property
    def stats(self):
        """The Generator's GenerationStats for this request (None until it finished)."""
        return self._job.stats

    @property
    def queue_seconds(self) -> float:
        start = self._job.started_at or time.monotonic()
        return max(0.0, start - self._job.created_at)

    @property
    def total_seconds(self) -> float:
        end = self._job.ended_at or time.monotonic()
        return max(0.0, end - self._job.created_at)

    @property
    def finish_reason(self) -> str | None:
        return self._job.finish_reason

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache (not evaluated again)."""
        return self._job.cached_tokens


@dataclass
class _Job:
    id: int
    request: GenerationRequest
    params: Any
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    created_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    ended_at: float | None = None
    stats: Any = None
    finish_reason: str | None = None
    cached_tokens: int = 0


class Engine:
    """Owns the Generator; serves :meth:`submit` calls from a bounded FIFO, one at a time."""

    def __init__(self, generator, tokenizer, *, model_name: str, max_context: int,
                 defaults: SamplingDefaults | None = None, max_queue: int = 16, model_info: dict | None = None,
                 images=None):
        self.generator = generator
        self.images = images  # a vision-language model's multimodal.chat.ImageSupport; None: text only
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = int(max_context)
        self.defaults = defaults or SamplingDefaults()
        self.max_queue = max(0, int(max_queue))
        self.model_info = dict(model_info or {})
        self.loaded_at = time.time()
        self.load_seconds = float(self.model_info.get("load_seconds", 0.0))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.model_lock = threading.Lock()  # one forward at a time: a generation step or an embedding
        self._waiting: deque[_Job] = deque()
        self._wakeup = queue.SimpleQueue()
        self._running: _Job | None = None
        self._durations: deque[float] = deque(maxlen=16)
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.last_finish_reason: str | None = None
        self._worker: threading.Thread | None = None
        self._stopping = False
        from .metrics import ServerMetrics

        self.metrics = ServerMetrics(self)  # GET /metrics

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._stopping = False
            self._worker = threading.Thread(target=self._run, name="kt-engine", daemon=True)
            self._worker.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        with self._lock:
            jobs = list(self._waiting) + ([self._running] if self._running else [])
        for j in jobs:
            j.cancel.set()
        self._wakeup.put(None)
        if self._worker is not None:
            self._worker.join(timeout)
        self._worker = None

    # ---- tokens ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Token ids the model can embed: [0, vocab_size)."""
        cfg = getattr(getattr(self.generator, "model", None), "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()
        n = getattr(cfg, "vocab_size", None)
        return int(n) if n else len(self.tokenizer)

    def check_token_ids(self, ids, param: str) -> list[int]:
        """``ids`` as a list, or a 400 naming the first id outside the vocabulary."""
        n = self.vocab_size
        for i, t in enumerate(ids):
            if not (0 <= t < n):
                raise APIError(400, f"'{param}[{i}]': token id {t} is outside the vocabulary (0..{n - 1})",
                               param=param)
        return list(ids)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry as the tokenizer spells it (byte-level BPE one
        character per byte, SentencePiece one per character): no token covers more text than that."""
        try:
            vocab = self.tokenizer.get_vocab()
        except Exception:  # a tokenizer without a vocabulary listing: no bound
            return 0
        return max((len(k) for k in vocab), default=0)

    @property
    def max_prompt_chars(self) -> int | None:
        """Prompt text longer than this cannot fit the context whatever it tokenizes to (each token
        covers at most ``longest_token_chars``); such text is refused before it is tokenized."""
        return self.max_context * self.longest_token_chars or None

    def check_prompt_chars(self, n_chars: int, param: str) -> None:
        """A 400 for prompt text too long to fit, before the tokenizer spends time (and memory) on it."""
        limit = self.max_prompt_chars
        if limit is not None and n_chars > limit:
            raise APIError(400, f"prompt text is {n_chars} characters; this server's context holds "
                                f"{self.max_context} tokens (--cache_lens), which no text of more than {limit} "
                                f"characters fits in this tokenizer", param=param, code="context_length_exceeded")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as the model's tokenizer makes them by default (with its own BOS
        setting), the same way local_chat does; ``add_special_tokens=False`` for a continuation."""
        _check_unicode(text, "prompt")
        self.check_prompt_chars(len(text), "prompt")
        if hasattr(self.generator, "encode"):
            return list(self.generator.encode(text, add_special_tokens=add_special_tokens))
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        t = getattr(self.tokenizer, "chat_template", None)
        if isinstance(t, dict):
            t = t.get("default") or next(iter(t.values()), None)
        return t

    @property
    def template_supports_tools(self) -> bool:
        t = self.chat_template or ""
        return "tools" in t

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
        """Prompt ids; ``template_kwargs`` are variables for the template (``enable_thinking`` ...)."""
        for i, m in enumerate(messages):
            _check_unicode(m.get("content"), f"messages[{i}].content")
        self.check_prompt_chars(text_chars(messages) + text_chars(tools), "messages")
        try:
            return list(self.generator.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                           tools=tools, **(template_kwargs or {})))
        except APIError:
            raise
        except Exception as e:  # jinja TemplateError, raise_exception() in the template, bad roles ...
            raise APIError(400, f"the chat template rejected these messages: {type(e).__name__}: {e}",
                           param="messages") from None

    # ---- requests --------------------------------------------------------------------
    def make_params(self, req: GenerationRequest):
        from ..generation import SamplingParams

        d = self.defaults
        n = len(req.input_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty (0 tokens)", param="prompt")
        cfg = getattr(getattr(self.generator, "model", None), "config", None)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg  # a VL model's text part
        model_limit = getattr(cfg, "max_position_embeddings", None)
        if n >= self.max_context:
            raise PromptTooLong(n, self.max_context, model_limit=model_limit)
        room = self.max_context - n
        max_new = d.max_new_tokens if req.max_new_tokens is None else int(req.max_new_tokens)
        if max_new < 1:
            raise APIError(400, f"max tokens must be at least 1 (got {max_new})", param="max_tokens")
        if req.max_new_tokens is not None and max_new > room:  # the server's default is capped instead
            raise PromptTooLong(n, self.max_context, max_new, model_limit=model_limit)
        top_p = float(d.top_p if req.top_p is None else req.top_p)
        temperature = float(d.temperature if req.temperature is None else req.temperature)
        if temperature < MIN_TEMPERATURE:  # logits / 1e-300 overflow to inf and NaN; the limit is greedy
            temperature = 0.0
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p if top_p > 0 else 1e-6,  # OpenAI allows 0: keep only the most likely token
            top_k=int(d.top_k if req.top_k is None else req.top_k),
            max_new_tokens=min(max_new, room),
            stop=[s for s in (req.stop or []) if s],
            seed=None if req.seed is None else int(req.seed) % SEED_MODULUS,
            repetition_penalty=float(d.repetition_penalty if req.repetition_penalty is None
                                     else req.repetition_penalty),
        )
        try:
            return params.validate()
        except KTError as e:
            raise APIError(400, str(e)) from None

    async def submit(self, req: GenerationRequest) -> EngineStream:
        """Queue ``req``; raises QueueFull / PromptTooLong / APIError before anything is queued."""
        params = self.make_params(req)
        self.check_token_ids(req.input_ids, "prompt")
        if self._stopping:
            raise APIError(503, "server is shutting down", headers={"Retry-After": "5"})
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._queue_full():
                raise QueueFull(self._retry_after(), self._queued())
            job = self._new_job(next(self._ids), req, params, loop, asyncio.Queue())
            self._waiting.append(job)
        self._wakeup.put(job)
        return EngineStream(job)

    def _new_job(self, job_id, req, params, loop, events) -> _Job:
        return _Job(job_id, req, params, loop, events)

    def _queued(self) -> int:
        """Requests accepted but not yet running."""
        return len(self._waiting)

    def _queue_full(self) -> bool:
        """A new request would wait beyond ``max_queue`` (the lock is held)."""
        return self._queued() >= self.max_queue and (self._running is not None or bool(self._waiting))

    def _retry_after(self) -> int:
        avg = (sum(self._durations) / len(self._durations)) if self._durations else 2.0
        return int(min(60, max(1, round(avg * (self._queued() + 1) / 2))))

    def status(self) -> dict:
        with self._lock:
            running = self._running
            return {
                "model": self.model_name,
                "running": None if running is None else {"id": running.id, "tag": running.request.tag,
                                                         "prompt_tokens": len(running.request.input_ids)},
                "waiting": len(self._waiting),
                "max_queue": self.max_queue,
                "max_context": self.max_context,
                **self.counts,
                "last_finish_reason": self.last_finish_reason,
            }

    # ---- embeddings ------------------------------------------------------------------
    @property
    def embedding_size(self) -> int | None:
        """Dimensions of an embedding: the model's hidden size."""
        cfg = getattr(getattr(self.generator, "model", None), "config", None)
        if cfg is not None and hasattr(cfg, "get_text_config"):
            cfg = cfg.get_text_config()
        n = getattr(cfg, "hidden_size", None)
        return int(n) if n else None

    def embed(self, ids: list[int]):
        """The final hidden state (after the model's last norm) at the last of ``ids``, fp32 on the
        CPU: in a decoder only the last position has attended to the whole input. One forward
        without a cache, between the worker's steps (``model_lock``)."""
        import torch

        model = self.generator.model
        device = getattr(self.generator, "device", None) or torch.device("cpu")
        x = torch.tensor([self.check_token_ids(ids, "input")], dtype=torch.long, device=device)
        with self.model_lock, torch.inference_mode():
            out = model.get_decoder()(input_ids=x, use_cache=False)
        return out.last_hidden_state[0, -1].float().cpu()

    def _one_step_at_a_time(self, events):
        """``events`` with the model lock held while each one is computed, so an embedding forward
        (``embed``) runs between two steps of a generation, never inside one."""
        it = iter(events)
        while True:
            with self.model_lock:
                ev = next(it, _END)
            if ev is _END:
                return
            yield ev

    # ---- worker ----------------------------------------------------------------------
    def _emit(self, job: _Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # loop closed: nobody is listening any more
            job.cancel.set()

    def _run(self) -> None:
        while True:
            token = self._wakeup.get()
            if token is None:
                if self._stopping:
                    break
                continue
            with self._lock:
                if not self._waiting:
                    continue
                job = self._waiting.popleft()
                self._running = job
            try:
                self._serve(job)
            finally:
                with self._lock:
                    self._running = None

    def _serve(self, job: _Job) -> None:
        from ..generation import TokenEvent

        job.started_at = time.monotonic()
        reason = None
        try:
            if job.cancel.is_set():
                reason = "cancelled"
                self._emit(job, TokenEvent(None, "", "cancelled"))
            else:
                first = True
                for ev in self._one_step_at_a_time(self.generator.stream(job.request.input_ids, job.params,
                                                                         job.cancel)):
                    if ev.finish_reason is not None:
                        reason = ev.finish_reason
                    if ev.token_id is not None:
                        if first:
                            self.metrics.record_first_token(time.monotonic() - job.created_at)
                            first = False
                        self.metrics.record_tokens(1)
                    self._emit(job, ev)
                if reason is None:  # a generator that ended without a final event
                    reason = "cancelled" if job.cancel.is_set() else "stop"
                    self._emit(job, TokenEvent(None, "", reason))
                job.stats = getattr(self.generator, "last_stats", None)
                if job.stats is not None:
                    self.metrics.record_speculation(getattr(job.stats, "drafted_tokens", 0),
                                                    getattr(job.stats, "accepted_tokens", 0))
        except Exception as e:  # the model failed: report to this request, keep serving others
            log.exception("generation %d failed", job.id)
            reason = "error"
            self._emit(job, APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))
        finally:
            job.ended_at = time.monotonic()
            job.finish_reason = reason
            self.last_finish_reason = reason
            key = {"cancelled": "cancelled", "error": "failed"}.get(reason, "completed")
            self.counts[key] += 1
            if reason != "cancelled":
                self._durations.append(job.ended_at - job.started_at)
            self.metrics.record_request(job.ended_at - job.created_at)
            self._emit(job, _END)

