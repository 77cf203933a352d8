"""A simple batch runner with the paged runner's interface: the tests' oracle (the server always
steps the paged runner, ``batch_engine.runner_class``).

Each sequence keeps its own transformers ``DynamicCache`` and runs its own forward; the page
pool only *counts* pages (``ceil(len / page_size)`` per sequence), so the scheduler's page
accounting, preemption and the prefix cache's reference counting behave exactly as over the
real pool.  A page's K/V can still be read (sliced out of its owner's cache) and written (kept
in the pool), so a prefix cache works over it too.  It is correct for every architecture the
single-request Generator serves, and slow: one forward per sequence per step.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import KTError
from ..generation.page_ids import OutOfPages, PageIds  # noqa: F401 - OutOfPages: public here too


class PagePool(PageIds):
    """Page ids counted as the paged runner's pool counts them (:class:`PageIds`); a page's K/V is
    what was written to it, else read from its owner's cache (``reader``)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise KTError(f"page pool needs at least 1 page of at least 1 token (got {num_pages} x {page_size})")
        super().__init__(num_pages)
        self.page_size = int(page_size)
        self._stored: dict[int, dict[str, torch.Tensor]] = {}
        self.reader: Callable[[int], dict[str, torch.Tensor] | None] | None = None  # set by the runner

    def _freed(self, page: int) -> None:
        self._stored.pop(page, None)

    def read_page(self, page: int) -> dict[str, torch.Tensor]:
        if page in self._stored:
            return self._stored[page]
        got = self.reader(page) if self.reader is not None else None
        if got is None:
            raise KTError(f"page {page} holds no K/V (free, or not yet written)")
        return got

    def write_page(self, page: int, payload: dict[str, torch.Tensor]) -> None:
        if self.refcount(page) <= 0:
            raise KTError(f"page {page} is free; allocate it before writing")
        self._stored[page] = {k: v.detach().to("cpu").clone() for k, v in payload.items()}


class _Seq:
    __slots__ = ("cache", "pages", "length", "rope_delta")

    def __init__(self, cache):
        self.cache = cache
        self.pages: list[int] = []
        self.length = 0
        self.rope_delta = 0  # M-RoPE shift of the text after a prompt with images


def _module_device(model) -> torch.device:
    emb = model.get_input_embeddings()
    for t in emb.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


class BatchRunner:
    """``step`` runs each chunk through its own sequence's cache; pages are only accounted."""

    def __init__(self, model, *, page_size: int, num_pages: int):
        self.model = model
        self.pool = PagePool(num_pages, page_size)
        self.pool.reader = self._read_owned_page
        self.device = _module_device(model)
        self._seqs: dict[int, _Seq] = {}

    # ---- sequences -------------------------------------------------------------------
    def begin(self, seq_id: int, prefix_pages=(), prefix_len: int = 0) -> None:
        from transformers import DynamicCache

        if seq_id in self._seqs:
            raise KTError(f"sequence {seq_id} already begun")
        ps = self.pool.page_size
        prefix_pages = list(prefix_pages)
        if prefix_len != len(prefix_pages) * ps:
            raise KTError(f"prefix of {prefix_len} tokens is not {len(prefix_pages)} full pages of {ps}")
        seq = _Seq(DynamicCache(config=self.model.config))
        if prefix_pages:
            payloads = [self.pool.read_page(p) for p in prefix_pages]
            n_layers = len({k.split(".")[1] for k in payloads[0]})
            for i in range(n_layers):
                k = torch.cat([pl[f"layers.{i}.keys"] for pl in payloads], dim=-2).to(self.device)
                v = torch.cat([pl[f"layers.{i}.values"] for pl in payloads], dim=-2).to(self.device)
                seq.cache.update(k, v, i)
            for p in prefix_pages:
                self.pool.incref(p)
            seq.pages = prefix_pages
            seq.length = prefix_len
        self._seqs[seq_id] = seq

    def seq_len(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def seq_pages(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].pages)

    def pages_needed(self, seq_id: int, n_new: int) -> int:
        seq = self._seqs.get(seq_id)
        have = len(seq.pages) if seq else 0
        length = seq.length if seq else 0
        return max(0, -(-(length + n_new) // self.pool.page_size) - have)

    def release(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for p in seq.pages:
            if self.pool.refcount(p) > 1 and p not in self.pool._stored:
                # someone else (the prefix cache) keeps the page: keep its K/V with it
                self.pool._stored[p] = self._page_payload(seq, seq.pages.index(p))
            self.pool.decref(p)

    # ---- pages' contents ----------------------------------------------------------------
    def _page_payload(self, seq: _Seq, index: int) -> dict[str, torch.Tensor]:
        ps = self.pool.page_size
        out = {}
        for i, layer in enumerate(seq.cache.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or keys.shape[-2] != seq.length:
                raise KTError(f"layer {i} does not keep every token's K/V ({type(layer).__name__}); "
                              "its pages cannot be read")
            out[f"layers.{i}.keys"] = keys[..., index * ps:(index + 1) * ps, :].detach().to("cpu").clone()
            out[f"layers.{i}.values"] = values[..., index * ps:(index + 1) * ps, :].detach().to("cpu").clone()
        return out

    def _read_owned_page(self, page: int) -> dict[str, torch.Tensor] | None:
        for seq in self._seqs.values():
            if page in seq.pages:
                index = seq.pages.index(page)
                if (index + 1) * self.pool.page_size <= seq.length:
                    return self._page_payload(seq, index)
        return None

    # ---- the step ----------------------------------------------------------------------
    def step(self, chunks: list[tuple[int, list[int]]], prompt=(), images=None) -> torch.Tensor:
        """``BatchRunner.step``'s contract; ``prompt`` changes nothing here (every chunk is one call
        of the model's forward).  ``images``: ``{seq_id: VisionInputs}`` of whole prompts with
        pictures (multimodal/prompt.py; the rest after a cached start), read by the model's forward
        with them."""
        images = images or {}
        need = sum(self.pages_needed(sid, len(ids)) for sid, ids in chunks)
        if need > self.pool.free_count() and self.pool.on_pressure is not None:
            self.pool.on_pressure(need - self.pool.free_count())
        if need > self.pool.free_count():
            raise OutOfPages(f"step needs {need} pages, {self.pool.free_count()} free")
        rows = []
        with torch.inference_mode():
            for sid, ids in chunks:
                seq = self._seqs[sid]
                for _ in range(self.pages_needed(sid, len(ids))):
                    seq.pages.append(self.pool.alloc())
                x = torch.tensor([ids], dtype=torch.long, device=self.device)
                pos = torch.arange(seq.length, seq.length + len(ids), device=self.device).unsqueeze(0)
                kwargs = {}
                if sid in images:
                    kwargs, seq.rope_delta = images[sid].batch_kwargs(self.model, x, seq.length)
                    pos = kwargs.pop("position_ids")
                elif seq.rope_delta:
                    pos = torch.cat([pos[None], (pos + seq.rope_delta)[None].expand(3, 1, -1)])
                out = self.model(input_ids=x, cache=seq.cache, position_ids=pos, use_cache=True, logits_to_keep=1,
                                 **kwargs)
                seq.length += len(ids)
                rows.append(out.logits[0, -1].float())
        return torch.stack(rows)
