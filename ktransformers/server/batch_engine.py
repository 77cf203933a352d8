"""The batching engine: many requests share each forward (continuous batching).

Same interface as :class:`~.engine.Engine` (``submit`` -> :class:`~.engine.EngineStream` of
TokenEvents, ``status``, ``shutdown``, the prompt helpers, which it inherits); only the worker
differs.  One worker thread runs engine steps: the :class:`~.scheduler.Scheduler` picks the
chunks (one token per decoding request + prefill chunks up to ``chunk_size``), the runner runs
them as one forward, and each request whose next token is due samples it with its own sampler
(temperature, top-p/k, seed, repetition penalty) and turns it into text with its own
:class:`~ktransformers.generation.StreamOutput` (stop strings, EOS, max tokens).  A cancelled
request (client gone) leaves the batch and frees its pages before the next step.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

import torch

from .engine import _END, Engine, _Job
from ..errors import ConfigError
from ..generation.page_ids import OutOfPages
from .errors import APIError
from .scheduler import NoRoom, Scheduler, Sequence

log = logging.getLogger("ktransformers.server")


def runner_class():
    """The batch runner the engine steps: the paged runner (``generation/paged.py``, the one decode
    step over a shared page pool).  ``reference_runner.py`` is the tests' oracle, never served."""
    from ..generation.paged import BatchRunner

    return BatchRunner




def _put_all(items) -> None:
    for job, item in items:  # in the order the step produced them
        job.events.put_nowait(item)


@dataclass(eq=False)
class _BatchJob(_Job):
    seq: Sequence | None = None
    sampler: Any = None
    output: Any = None
    first_token_at: float | None = None
    last_token_at: float | None = None


class BatchEngine(Engine):
    """Serves up to ``max_batch_size`` requests at once over ``runner``'s shared page pool.

    ``generator`` is the single-request Generator of the same model: its prompt helpers
    (encode, chat template) and EOS ids are reused; its cache is never used here.
    """

    _held: list | None = None  # events of the step in progress (see _deliver_held)

    def __init__(self, generator, tokenizer, runner, *, model_name: str, max_context: int,
                 max_batch_size: int = 8, chunk_size: int = 512, prefix_cache=None, **kw):
        pool = runner.pool
        capacity = pool.num_pages * pool.page_size
        super().__init__(generator, tokenizer, model_name=model_name, max_context=min(int(max_context), capacity),
                         **kw)
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.scheduler = Scheduler(runner, max_batch_size=max_batch_size, chunk_size=chunk_size,
                                   prefix_cache=prefix_cache)
        self._jobs: list[_BatchJob] = []     # in the scheduler (waiting or running); worker-owned
        self._metrics = getattr(self, "metrics", None)  # the Engine's ServerMetrics (GET /metrics)
        self.steps = 0

    # ---- queue accounting (the lock is held) ---------------------------------------------
    def _queued(self) -> int:
        return len(self._waiting) + len(self.scheduler.waiting)

    def _queue_full(self) -> bool:
        free_slots = max(0, self.scheduler.max_batch_size - len(self.scheduler.running))
        return self._queued() - free_slots >= self.max_queue

    def _new_job(self, job_id, req, params, loop, events):
        return _BatchJob(job_id, req, params, loop, events)

    def status(self) -> dict:
        """Counters, requests and KV pages; read from any thread (a snapshot, not locked)."""
        running = [{"id": j.id, "tag": j.request.tag, "prompt_tokens": len(j.request.input_ids),
                    "generated_tokens": len(j.seq.generated), "cached_tokens": j.cached_tokens}
                   for j in list(self._jobs) if j.seq is not None and j.seq.begun]
        out = {
            "model": self.model_name,
            "backend": "balance_serve",
            **self.scheduler.status(),
            "running": len(running),
            "running_requests": running,
            "waiting": self._queued(),
            "max_queue": self.max_queue,
            "max_context": self.max_context,
            **self.counts,
            "last_finish_reason": self.last_finish_reason,
        }
        if self.prefix_cache is not None:
            out["prefix_cache"] = self.prefix_cache.stats()
        return out

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for j in jobs:
            j.cancel.set()
        super().shutdown(timeout)
        close = getattr(self.prefix_cache, "close", None)
        if close is not None:  # the device and RAM tiers go to disk, for the next start
            close()

    # ---- worker --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._take_new()
            self._drop_cancelled()
            if self._stopping:
                break
            if not self.scheduler.has_work():
                self._wakeup.get()
                continue
            try:
                with self.model_lock:  # an embedding forward (Engine.embed) waits for the step
                    self._step()
            except Exception as e:  # a bug outside the model call: never let the worker die
                log.exception("engine step failed")
                for job in list(self._jobs):
                    self._end(job, "error", APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                                     type="server_error"))
        for job in list(self._jobs):
            self._end(job, "cancelled")
        with self._lock:
            left = list(self._waiting)
            self._waiting.clear()
        for job in left:
            self._end(job, "cancelled")

    def _take_new(self) -> None:
        while True:
            try:
                self._wakeup.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            new = list(self._waiting)
            self._waiting.clear()
            for job in new:
                job.seq = Sequence(job.id, list(job.request.input_ids), job.params.max_new_tokens, owner=job,
                                   vision=getattr(job.request.input_ids, "vision", None))
                self.scheduler.add(job.seq)
                self._jobs.append(job)

    def _drop_cancelled(self) -> None:
        for job in list(self._jobs):
            if job.cancel.is_set():
                self._end(job, "cancelled")

    def _emit(self, job: _Job, item) -> None:
        if self._held is None:
            super()._emit(job, item)
        else:
            self._held.append((job, item))

    def _deliver_held(self) -> None:
        """Hand the events held during a step to their event loops: one wake-up per loop and step,
        not one per event (at batch 4 the per-event self-pipe writes and loop wake-ups took the CPU
        the kernel threads were waiting for)."""
        held, self._held = self._held, None
        by_loop: dict = {}
        for job, item in held or ():
            by_loop.setdefault(job.loop, []).append((job, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # loop closed: nobody is listening any more
                for job, _ in items:
                    job.cancel.set()

    def _step(self) -> None:
        self._held = []
        try:
            self._step_held()
        finally:
            self._deliver_held()

    def _step_held(self) -> None:
        from ..generation import Sampler, StreamOutput
        from ..generation.sampling import argmax_rows

        try:
            chunks = self.scheduler.schedule()
        except NoRoom as e:
            self._end(e.seq.owner, "error", APIError(500, str(e), type="server_error"))
            return
        if not chunks:
            return
        now = time.monotonic()
        for s, _ in chunks:
            job = s.owner
            if job.started_at is None:
                job.started_at = now
                job.cached_tokens = s.cached_tokens or 0
        images = {s.seq_id: s.vision for s, _ in chunks if s.vision is not None and not s.decoding}
        try:
            logits = self.runner.step([(s.seq_id, s.chunk(n)) for s, n in chunks],
                                      prompt={s.seq_id for s, _ in chunks if not s.decoding},
                                      **({"images": images} if images else {}))
        except OutOfPages as e:  # the planned pages were not there after all
            youngest = self.scheduler.running[-1]
            if len(self.scheduler.running) > 1:
                self.scheduler.preempt(youngest)
            else:
                self._end(youngest.owner, "error", APIError(500, f"out of KV pages: {e}", type="server_error"))
            return
        except Exception as e:  # the model failed on this batch: fail its requests, keep serving the others
            log.exception("engine step failed for requests %s", [s.seq_id for s, _ in chunks])
            for s, _ in chunks:
                self._end(s.owner, "error", APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                                     type="server_error"))
            return
        self.steps += 1
        rows = {id(s): i for i, (s, _) in enumerate(chunks)}
        due = self.scheduler.advance(chunks)
        if self._metrics is not None:
            self._metrics.record_tokens(len(due))
        for s in due:
            job: _BatchJob = s.owner
            if job.sampler is None:
                job.sampler = Sampler(job.params, logits.device)
                job.output = StreamOutput(self.tokenizer, job.request.input_ids, job.params,
                                          self.generator.eos_ids, job.params.max_new_tokens,
                                          keep_ids=getattr(self.generator, "keep_special_ids", frozenset()))
        # greedy rows without processors: one argmax over their rows (per-row calls over a
        # 262k vocabulary cost about twice as much at batch 4)
        plain = [s for s in due if s.owner.sampler.argmax_only]
        argmax: dict[int, int] = {}
        if plain:
            with torch.inference_mode():
                picked = argmax_rows(logits[[rows[id(s)] for s in plain]])
            argmax = {id(s): t for s, t in zip(plain, picked)}
        for s in due:
            job = s.owner
            token = argmax.get(id(s))
            if token is None:
                row = logits[rows[id(s)]].unsqueeze(0)
                ids = torch.tensor([s.tokens], dtype=torch.long, device=row.device) if job.sampler.needs_ids else None
                with torch.inference_mode():
                    token = job.sampler(row, ids)
            t = time.monotonic()
            if job.first_token_at is None:
                job.first_token_at = t
                if self._metrics is not None:
                    self._metrics.record_first_token(t - job.created_at)
            job.last_token_at = t
            s.generated.append(token)
            event = job.output.add(token)
            if event is not None:
                self._emit(job, event)
            if job.output.finish_reason is not None:
                self._end(job, job.output.finish_reason)
            elif job.cancel.is_set():
                self._end(job, "cancelled")

    def _end(self, job: _BatchJob, reason: str, error: BaseException | None = None) -> None:
        """Finish ``job``: free its pages, send its last event, count it."""
        from ..generation import GenerationStats, TokenEvent

        if job.finish_reason is not None:
            return
        s = job.seq
        if s is not None:
            if reason in ("stop", "length"):
                self.scheduler.finish(s)
            else:
                self.scheduler.drop(s)
        if job in self._jobs:
            self._jobs.remove(job)
        job.ended_at = time.monotonic()
        job.finish_reason = reason
        self.last_finish_reason = reason
        if s is not None and job.started_at is not None:
            first = job.first_token_at or job.ended_at
            job.stats = GenerationStats(
                prompt_tokens=len(s.prompt), prefill_seconds=max(0.0, first - job.started_at),
                generated_tokens=job.output.generated if job.output else 0,
                decode_seconds=max(0.0, (job.last_token_at or first) - first),
                cached_tokens=job.cached_tokens)
        if error is not None:
            self._emit(job, error)
        elif job.output is not None:
            self._emit(job, job.output.final(reason))
        else:
            self._emit(job, TokenEvent(None, "", reason))
        key = {"cancelled": "cancelled", "error": "failed"}.get(reason, "completed")
        self.counts[key] += 1
        if reason not in ("cancelled", "error") and job.started_at is not None:
            self._durations.append(job.ended_at - job.started_at)
        if self._metrics is not None:
            self._metrics.record_request(job.ended_at - job.created_at)
        self._emit(job, _END)


def make_prefix_cache(settings, model, pool):
    """The prefix cache over ``pool`` with the tiers the settings ask for, or None when the
    prefix-cache module is not installed (the engine then recomputes every prompt)."""
    wanted = settings.prefix_cache_ram_gb > 0 or settings.prefix_cache_dir
    try:
        from .prefix_cache import PrefixCache, model_fingerprint
    except ImportError:
        if wanted:
            log.warning("--prefix_cache_* given but this build has no prefix cache; prompts are recomputed")
        return None
    weights = settings.gguf_path or settings.model_path
    return PrefixCache(pool, fingerprint=model_fingerprint(model, weights), page_size=pool.page_size,
                       ram_bytes=int(settings.prefix_cache_ram_gb * 2**30), disk_dir=settings.prefix_cache_dir,
                       disk_bytes=int(settings.prefix_cache_disk_gb * 2**30))


def pool_tokens(settings, max_positions: int) -> int:
    """The tokens of the KV page pool: ``--cache_lens``, else the model's max positions up to
    DEFAULT_POOL_TOKENS."""
    from .settings import DEFAULT_POOL_TOKENS

    return settings.cache_lens or min(max_positions, DEFAULT_POOL_TOKENS)


def build_batch_engine(settings, model, tokenizer, max_positions: int, **common) -> BatchEngine:
    """A BatchEngine over ``model``: a pool of ``--cache_lens`` tokens in ``--page_size`` pages."""
    from ..generation import Generator

    pool = pool_tokens(settings, max_positions)
    num_pages = max(1, pool // settings.page_size)
    from ..generation.paged import PoolTooLarge

    try:
        runner = runner_class()(model, page_size=settings.page_size, num_pages=num_pages)
    except PoolTooLarge as e:
        raise ConfigError(f"--cache_lens {pool}: {e}; lower --cache_lens") from None
    prefix_cache = make_prefix_cache(settings, model, runner.pool)
    generator = Generator(model, tokenizer, chunk_size=settings.prefill_chunk)  # prompt helpers, EOS ids
    log.info("batching: %d KV pages of %d tokens, up to %d requests, %d tokens per step (%s)", num_pages,
             settings.page_size, settings.max_batch_size, settings.prefill_chunk, type(runner).__module__)
    return BatchEngine(generator, tokenizer, runner, max_context=min(max_positions, num_pages * settings.page_size),
                       max_batch_size=settings.max_batch_size, chunk_size=settings.prefill_chunk,
                       prefix_cache=prefix_cache, **common)
