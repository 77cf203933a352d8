"""Continuous-batching scheduler: which requests run in the next engine step, and how many tokens each.

One engine step is ONE batched forward: every decoding request contributes one token, and the
rest of the token budget (``chunk_size``) goes to prefill chunks of admitted requests, oldest
first, so a long prompt is spread over several steps and never stalls the running streams.
Admission is first come, first served: a waiting request is admitted (at most
``max_batch_size`` run at once) only when its first chunk after its cached start fits the free
KV pages, and nobody overtakes the head of the queue.  The cached start is looked up before room
is made, so the pool's pressure never evicts the pages the request is about to reuse.  When decoding runs out of pages the youngest running request
is preempted: its pages are released and it goes back to the queue, to be recomputed later
(prompt + the tokens it already generated, re-prefilled, nothing re-emitted).

Pure bookkeeping over the runner's page interface (``pages_needed``, ``begin``, ``release``,
``pool.free_count``, ``pool.on_pressure``) and the optional prefix cache (``match``,
``insert``); the engine owns the model call, sampling and the text.

transformers' own continuous-batching scheduler is written against its ``PagedAttentionCache``
(block tables, safety margin, CPU offloading of starved requests, device-only block sharing);
this one is written against the runner's page pool, whose pages also hold MLA latents, and
against the tiered prefix cache, and it preempts the youngest request instead of offloading.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it.  ``seq_id`` grows with arrival: smaller = older."""

    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    computed: int = 0            # tokens whose KV the runner holds
    begun: bool = False          # known to the runner (holds pages)
    cached_tokens: int | None = None   # prompt tokens the prefix cache gave at first admission
    looked_up: bool = False      # its lookup is counted in the prefix cache's stats (until preempted)
    preemptions: int = 0
    owner: Any = None            # the engine's per-request state
    vision: Any = None           # a prompt with pictures (multimodal/prompt.py VisionInputs): read whole

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def total_len(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def pending(self) -> int:
        """Tokens not yet run through the model (1 while decoding)."""
        return self.total_len - self.computed

    @property
    def decoding(self) -> bool:
        return self.begun and bool(self.generated) and self.pending == 1

    def chunk(self, n: int) -> list[int]:
        """The next ``n`` token ids to run."""
        return self.tokens[self.computed:self.computed + n]


class NoRoom(Exception):
    """The page pool cannot hold ``seq``'s next tokens even with no other request running."""

    def __init__(self, seq: Sequence, pool):
        super().__init__(f"the KV page pool ({pool.num_pages} pages of {pool.page_size} tokens) cannot hold "
                         f"request {seq.seq_id}'s next tokens")
        self.seq = seq


class Scheduler:
    def __init__(self, runner, *, max_batch_size: int, chunk_size: int, prefix_cache=None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 (got {max_batch_size})")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (got {chunk_size})")
        self.runner = runner
        self.pool = runner.pool
        self.max_batch_size = int(max_batch_size)
        self.chunk_size = int(chunk_size)
        self.prefix_cache = prefix_cache
        self.waiting: list[Sequence] = []   # sorted by seq_id (arrival); preempted ones go back in order
        self.running: list[Sequence] = []   # sorted by seq_id
        self.preemptions = 0
        self._reserved = 0                  # pages promised to chunks of the step being planned

    # ---- queue -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._insert_waiting(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        keys = [s.seq_id for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.seq_id), seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def drop(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished or cancelled) and free its pages at once."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.begun:
            self.runner.release(seq.seq_id)
            seq.begun = False

    def finish(self, seq: Sequence) -> None:
        """A request that ended normally: index what it computed in the prefix cache, then drop it."""
        self._remember(seq)
        self.drop(seq)

    def _images(self, seq: Sequence) -> dict | None:
        """The prefix cache's keyword for ``seq``'s pictures: ``{}`` for text, ``{"images": spans}``
        (multimodal/prompt.py ``VisionInputs.spans``) for a prompt with pictures, None where the
        prompt's ids are not known to its pictures (never cached).  A picture's image tokens are the
        same placeholder ids whatever the picture: the spans' content digests in the keys keep pages
        made with one picture from answering another."""
        if seq.vision is None:
            return {}
        if getattr(seq.vision, "ids", None) != seq.prompt:
            return None
        return {"images": seq.vision.spans()}

    def _remember(self, seq: Sequence) -> None:
        if self.prefix_cache is None or not seq.begun or seq.computed < self.pool.page_size:
            return
        images = self._images(seq)
        if images is not None:
            self.prefix_cache.insert(seq.tokens[:seq.computed], list(self.runner.seq_pages(seq.seq_id)), **images)

    # ---- pages -----------------------------------------------------------------------
    def _free(self) -> int:
        return self.pool.free_count() - self._reserved

    def _available(self, need: int) -> bool:
        """True when ``need`` more pages are free, after asking the prefix cache to evict."""
        short = need - self._free()
        if short > 0 and getattr(self.pool, "on_pressure", None) is not None:
            self.pool.on_pressure(short)
        return self._free() >= need

    def _fit(self, seq: Sequence, n: int) -> int:
        """The most of the next ``n`` tokens of ``seq`` whose pages are free (binary search)."""
        if n <= 0:
            return 0
        if self._available(self.runner.pages_needed(seq.seq_id, n)):
            return n
        lo, hi = 0, n  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.runner.pages_needed(seq.seq_id, mid) <= self._free():
                lo = mid
            else:
                hi = mid
        return lo

    def _pages_for_new(self, n: int) -> int:
        ps = self.pool.page_size
        return -(-n // ps)

    def preempt(self, seq: Sequence) -> None:
        """Release ``seq``'s pages and queue it again; it is recomputed when readmitted."""
        self.running.remove(seq)
        self.runner.release(seq.seq_id)
        seq.begun = False
        seq.computed = 0
        seq.looked_up = False  # readmitted from scratch: a lookup of its own
        seq.preemptions += 1
        self.preemptions += 1
        self._insert_waiting(seq)

    def _match(self, seq: Sequence) -> tuple[list[int], int]:
        """The prefix cache's pages for ``seq``'s start (a reference held on each) and their tokens;
        the cache's stats count one lookup per admission, not one per try while it waits for pages."""
        images = self._images(seq) if self.prefix_cache is not None else None
        count, seq.looked_up = not seq.looked_up, True
        if images == {}:
            pages, n, _tiers = self.prefix_cache.match(seq.tokens, count=count)
        elif images is not None:  # a cached start within the prompt: the runner reads the rest by its ids
            pages, n, _tiers = self.prefix_cache.match(seq.prompt, **images, count=count)
        else:
            pages, n = [], 0
        return pages, n

    def _admit_head(self, keep: int, budget: int | None = None) -> bool:
        """Admit the head of the queue when the pages for its first chunk (its whole prompt when
        ``budget`` is None, else at most ``budget`` tokens) after its cached start are free, with
        ``keep`` more in hand.  The cached start is looked up first: the references held keep the
        pool's pressure from evicting the pages it is about to reuse while room is made for the
        rest; a lookup that finds no room is given back."""
        head = self.waiting[0]
        pages, n = self._match(head)
        rest = head.total_len - n
        first = rest if budget is None else min(rest, budget)
        if not self._available(self._pages_for_new(n + first) - len(pages) + keep):
            for p in pages:
                self.pool.decref(p)
            return False
        self._admit(head, pages, n)
        return True

    def _admit(self, seq: Sequence, pages: list[int], n: int) -> None:
        try:
            self.runner.begin(seq.seq_id, pages, n)
        finally:
            for p in pages:  # match gave us a reference each; the runner holds its own now
                self.pool.decref(p)
        seq.begun = True
        seq.computed = n
        if seq.cached_tokens is None:
            seq.cached_tokens = n
        self.waiting.remove(seq)
        self.running.append(seq)
        self.running.sort(key=lambda s: s.seq_id)

    # ---- planning --------------------------------------------------------------------
    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's chunks: ``[(seq, n_tokens)]``, decodes first.  Raises NoRoom when the
        pool cannot take even one request's next token (only possible with a broken pool)."""
        while True:
            chunks = self._plan()
            if chunks or not self.has_work():
                return chunks
            if not self.running:
                raise NoRoom(self.waiting[0], self.pool)
            if len(self.running) == 1:
                raise NoRoom(self.running[0], self.pool)
            self.preempt(self.running[-1])  # everyone is stuck on pages: the youngest gives way

    def _whole(self) -> list[tuple[Sequence, int]] | None:
        """A step of its own for a prompt with pictures (read whole, from the end of its cached start:
        the vision tower's features fill its image tokens in one forward), running or at the head of
        the queue, when its pages are free (keeping a page per decoding request in hand); None
        otherwise."""
        decoding = sum(1 for s in self.running if s.decoding)
        for s in self.running:
            if s.vision is not None and not s.decoding and s.pending > 0:
                return [(s, s.pending)] if self._available(self.runner.pages_needed(s.seq_id, s.pending)) else None
        head = self.waiting[0] if self.waiting else None
        if head is None or head.vision is None or len(self.running) >= self.max_batch_size:
            return None
        return [(head, head.pending)] if self._admit_head(decoding) else None

    def _plan(self) -> list[tuple[Sequence, int]]:
        self._reserved = 0
        whole = self._whole()
        if whole is not None:
            return whole
        # 1. every decoding request gets its token; short of pages, the youngest is preempted
        while True:
            decodes = [s for s in self.running if s.decoding]
            need = sum(self.runner.pages_needed(s.seq_id, 1) for s in decodes)
            if self._available(need) or not self.running:
                break
            self.preempt(self.running[-1])
        chunks: list[tuple[Sequence, int]] = [(s, 1) for s in decodes]
        self._reserved = need
        budget = self.chunk_size - len(decodes) if decodes else self.chunk_size
        # 2. prefill chunks of admitted requests, oldest first
        for s in self.running:
            if budget <= 0:
                break
            if s.decoding or s.pending <= 0 or s.vision is not None:  # pictures: _whole
                continue
            n = self._fit(s, min(s.pending, budget))
            if n > 0:
                chunks.append((s, n))
                self._reserved += self.runner.pages_needed(s.seq_id, n)
                budget -= n
        # 3. admit waiting requests in arrival order while their first chunk fits, keeping a page
        #    per decoding request in hand for the next step
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            head = self.waiting[0]
            if head.vision is not None:  # admitted by _whole when its pages are free
                break
            if not self._admit_head(len(decodes), budget):
                break
            n = self._fit(head, min(head.pending, budget))
            if n <= 0:
                break
            chunks.append((head, n))
            self._reserved += self.runner.pages_needed(head.seq_id, n)
            budget -= n
        self._reserved = 0
        return chunks

    def advance(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """After the step ran: record the computed tokens; the sequences whose next token is due
        (prefill just completed, or a decode), in chunk order."""
        due = []
        for s, n in chunks:
            was_prefill = not s.decoding
            s.computed += n
            if s.pending == 0:
                if was_prefill and not s.generated:
                    self._remember(s)  # the prompt's full pages, for later requests sharing it
                due.append(s)
        return due

    def status(self) -> dict:
        used, free = self.pool.used_count(), self.pool.free_count()
        return {"running": len(self.running), "waiting": len(self.waiting),
                "max_batch_size": self.max_batch_size, "chunk_size": self.chunk_size,
                "preemptions": self.preemptions,
                "kv_pages": {"page_size": self.pool.page_size, "total": self.pool.num_pages,
                             "used": used, "free": free}}
