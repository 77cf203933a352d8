"""Paged KV cache and the batched forward of continuous batching: ``PagePool`` and ``BatchRunner``.

A **page** is ``page_size`` consecutive token slots in *every* attention layer of the model at once,
so one page id addresses a block of tokens of a sequence across the whole model.  Per layer the
pool holds, page-major (``[num_pages * page_size, ...]``, page ``p`` = rows ``p*S .. p*S+S-1``):

* softmax attention (MHA/GQA: Llama, Qwen, Mixtral, Gemma-3 full and sliding-window layers):
  ``layers.{i}.key [slots, kv_heads, head_dim]`` and ``layers.{i}.value [slots, kv_heads, head_dim]``
  (after RoPE / k-norm, exactly what the layer would put into a transformers ``Cache``);
* DeepSeek MLA (``KDeepseekV2Attention``): ``layers.{i}.latent [slots, kv_lora_rank]`` (normed
  compressed latent) and ``layers.{i}.rope_key [slots, qk_rope_head_dim]`` (roped shared key).

The pool tensors of a layer live on that attention layer's device (where the rules put it), in the
model's dtype.  A sequence's *block table* is its list of page ids; token ``n`` sits in page
``pages[n // page_size]`` at row ``n % page_size``.

``BatchRunner.step`` runs ONE model forward over the packed tokens of all sequences of the step
(prefill chunks and single decode tokens mixed): ``input_ids [1, T]`` with per-sequence positions.
Every non-attention op (linears, norms, MoE: the CPU experts get all ``T`` tokens in one call,
grouped per expert by the kernel) runs once for the whole step.  Attention writes the new K/V (or
latent) rows into the pages, then attends per sequence:

* the single-token sequences of the step in padded batched calls (keys gathered from the pages
  into ``[n, L_max]`` with a validity / sliding-window mask), one call per group of similar
  lengths (``_length_buckets``: equal lengths share one call, very unequal ones do not pay for
  reading padding);
* each multi-token chunk in its own call over its gathered keys (causal, offset by its past).

For softmax attention this is ``torch.nn.functional.scaled_dot_product_attention``, registered in
transformers' ``AttentionInterface`` as ``"kt_paged"`` and selected only for the duration of a step;
for MLA it is the latent kernel (``mla.latent_kernel_attention``, fp32 on the CPU) over the latent
pages, else ``KDeepseekV2Attention``'s own absorbed decode and chunk-invariant prompt attention
(``mla.causal_prompt_attention``) from ``operators/mla.py``: torch ops, so that path serves CUDA.

Gemma-3's sliding-window layers use the window in the mask; their pages are not freed early
because a page holds every layer's rows and the full-attention layers still need them.

Why not transformers' own continuous batching (``PagedAttentionCache`` + ``ModelRunner``): its
allocators are sized ``[kv_heads, head_dim]`` from the config and have no latent layout (MLA's
``cache.update`` fails there), it keeps block sharing to its own token-hash ledger (no per-page
reference counts, no page contents to move to RAM/disk tiers), its model runner samples by itself
(no ``step(chunks) -> logits`` for our sampling and stop strings), and on CPU its batched attention
is one call over every request's keys with a block-diagonal mask, which costs
``tokens x all keys`` instead of each chunk's own keys.  Its pieces used here: the attention
interface registration, the in-place ``cache.update(..., kwargs=...)`` hand-over, the mask
early-exit for a custom attention name, and ``logits_to_keep`` with an index tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.attention import flash_attention_paged
from ..operators.cpu_threads import kernel_pool
from .decode_step import decode_step_for
from .devices import module_device
from .page_ids import OutOfPages, PageIds

PAGED_ATTENTION = "kt_paged"


class PoolTooLarge(ValueError):
    """The pool asked for would not fit the memory its devices have free (checked before allocating)."""


def _free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can take (MemAvailable for the CPU), or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        from ..kernels.pool import free_host_bytes

        return free_host_bytes()
    return None


# ------------------------------------------------------------------------------------ the pool


@dataclass(frozen=True)
class PageTensor:
    """One per-layer tensor of the pool: rows per token ``shape`` (after the slot dim)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class PagePool(PageIds):
    """Pages with reference counts (``alloc``, ``reserve``, ``incref``/``decref``: :class:`PageIds`)
    over per-layer storage tensors (one pool per model).

    * A page freed keeps its contents as they are; a later owner overwrites them.
    * ``read_page`` / ``write_page``: every layer's rows of one page, keyed like the layout
      (``"layers.{i}.key"`` …), as CPU tensors ``[page_size, *shape]``; ``write_page`` needs exactly
      the layout's keys, shapes and dtypes and copies them onto each layer's device.

    Not thread-safe: one engine thread drives the pool (and the runner).
    """

    def __init__(self, page_size: int, num_pages: int, layout: dict[str, PageTensor]):
        if int(page_size) < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if int(num_pages) < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.page_size = int(page_size)
        self.num_pages = int(num_pages)
        self.layout = dict(layout)
        slots = self.page_size * self.num_pages
        need: dict[torch.device, int] = {}
        for spec in self.layout.values():
            row = math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
            need[spec.device] = need.get(spec.device, 0) + slots * row
        for dev, n in need.items():
            free = _free_bytes(dev)
            if free is not None and n > free:
                raise PoolTooLarge(f"{self.num_pages} pages of {self.page_size} tokens need {n / 2**30:.2f} GiB on "
                                   f"{dev}, which has {free / 2**30:.2f} GiB available")
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.zeros((slots, *spec.shape), dtype=spec.dtype, device=spec.device)
            for name, spec in self.layout.items()
        }
        super().__init__(self.num_pages)

    def bytes_per_page(self) -> int:
        return sum(t[: self.page_size].nbytes for t in self.tensors.values())

    # -- contents
    def page_rows(self, page: int) -> slice:
        p = self._check(page)
        return slice(p * self.page_size, (p + 1) * self.page_size)

    def read_page(self, page: int) -> dict[str, torch.Tensor]:
        rows = self.page_rows(page)
        return {name: t[rows].to("cpu", copy=True) for name, t in self.tensors.items()}

    def write_page(self, page: int, payload: dict[str, torch.Tensor]) -> None:
        rows = self.page_rows(page)
        missing = sorted(set(self.tensors) - set(payload))
        extra = sorted(set(payload) - set(self.tensors))
        if missing or extra:
            raise ValueError(f"write_page({page}): payload keys do not match the pool layout "
                             f"(missing {missing[:3]}, unexpected {extra[:3]})")
        for name, t in self.tensors.items():
            src = payload[name]
            want = (self.page_size, *t.shape[1:])
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != want or src.dtype != t.dtype:
                got = (tuple(src.shape), src.dtype) if isinstance(src, torch.Tensor) else type(src).__name__
                raise ValueError(f"write_page({page}): '{name}' must be {want} {t.dtype}, got {got}")
        for name, t in self.tensors.items():
            t[rows].copy_(payload[name])


# --------------------------------------------------------------------------- per-step batch


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    length: int = 0
    shared: int = 0  # leading pages given by begin(): read-only
    rope_delta: int = 0  # M-RoPE shift of the text after a prompt with images (0: none)


class _PagedBatch:
    """The ``cache=`` object of one step: writes each layer's new rows into the pages and attends.

    transformers' attention modules call ``update(k, v, layer_idx, kwargs)`` (rows written, the
    batch stashed in ``kwargs`` for the ``kt_paged`` attention function);
    ``KDeepseekV2Attention`` calls ``mla_attention`` instead.
    """

    is_paged_batch = True
    is_compileable = False

    def __init__(self, pool: PagePool, seqs: list[tuple[list[int], int, int]], prompt: list[bool] | None = None):
        """``seqs``: per chunk (block table incl. new pages, past length, new token count);
        ``prompt``: per chunk whether it is prompt tokens (a one-token prompt chunk is read as a
        prompt, not as a decoding row)."""
        S = pool.page_size
        self.pool = pool
        self.num_tokens = sum(t for _, _, t in seqs)
        write, positions, self.chunks, dec = [], [], [], []
        self.tables: list[torch.Tensor] = []  # per chunk its block table (the flash kernel reads the pages)
        self.prompt_flash = False  # set by BatchRunner._forward: the model's prompt attention is kt_sdpa
        start = 0
        for i, (pages, past, t) in enumerate(seqs):
            slots = _slots(pages, past + t, S)
            write.append(slots[past:])
            positions.append(torch.arange(past, past + t))
            if t == 1 and not (prompt and prompt[i]):
                dec.append((start, past, slots))
            else:
                self.chunks.append((start, t, past, slots))
                self.tables.append(torch.tensor(pages[: math.ceil((past + t) / S)], dtype=torch.int64))
            start += t
        self.write_slots = torch.cat(write)
        self.position_ids = torch.cat(positions).unsqueeze(0)
        self.last_index = torch.tensor([t for *_, t in seqs]).cumsum(0) - 1
        self.decode = [self._bucket(b) for b in _length_buckets(dec)]
        self._devcache: dict = {}

    # -- device copies and masks, built once per step per device / window
    def _on(self, name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        key = (name, device)
        got = self._devcache.get(key)
        if got is None:
            got = self._devcache[key] = t.to(device)
        return got

    @staticmethod
    def _bucket(dec):
        """(packed query index ``[n]``, past lengths ``[n]``, key rows ``[n, L_max]`` padded with row 0)."""
        lmax = max(p + 1 for _, p, _ in dec)
        read = torch.zeros(len(dec), lmax, dtype=torch.long)
        for j, (_, past, slots) in enumerate(dec):
            read[j, : past + 1] = slots
        return torch.tensor([s for s, _, _ in dec]), torch.tensor([p for _, p, _ in dec]), read

    def _decode_mask(self, b: int, device):
        """``[n, 1, 1, L_max]`` keep-mask of single-token bucket ``b`` (each row's own length), or
        None if every key is seen."""
        key = ("decode_mask", b, device)
        if key not in self._devcache:
            _, past, read = self.decode[b]
            keep = torch.arange(read.shape[1])[None, :] <= past[:, None]
            self._devcache[key] = None if bool(keep.all()) else keep[:, None, None, :].to(device)
        return self._devcache[key]

    def _decode_keys(self, b: int, store_device, device, window: int | None):
        """(key rows ``[n, L]``, keep-mask or None) of single-token bucket ``b`` for a layer with
        ``window``: a sliding-window layer reads only each sequence's last ``window`` keys, so its
        decode costs O(window), not O(context)."""
        _, past, read = self.decode[b]
        if window is None or read.shape[1] <= window:  # every key is in every row's window
            return self._on(("dec_read", b), read, store_device), self._decode_mask(b, device)
        key = ("dec_read_window", b, window)
        if key not in self._devcache:
            lo = (past + 1 - window).clamp(min=0)
            idx = lo[:, None] + torch.arange(int((past + 1 - lo).max()))[None, :]
            keep = idx <= past[:, None]
            rows = torch.gather(read, 1, idx.clamp(max=read.shape[1] - 1)).masked_fill(~keep, 0)
            mask = None if bool(keep.all()) else keep[:, None, None, :].to(device)
            self._devcache[key] = (rows.to(store_device), mask)
        return self._devcache[key]

    def _chunk_mask(self, i: int, t: int, past: int, device, window: int | None, lo: int = 0):
        """``[t, past+t-lo]`` causal (and windowed) keep-mask of chunk ``i`` over keys ``lo ..``;
        None: plain causal, no past."""
        if past == 0 and (window is None or window >= t):
            return None
        key = ("chunk_mask", i, device, window)
        if key not in self._devcache:
            qpos = torch.arange(past, past + t)[:, None]
            kpos = torch.arange(lo, past + t)[None, :]
            keep = kpos <= qpos
            if window is not None:
                keep &= kpos > qpos - window
            self._devcache[key] = keep.to(device)
        return self._devcache[key]

    def _write(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        store = self.pool.tensors[name]
        store.index_copy_(0, self._on("write", self.write_slots, store.device), rows.to(store.dtype))
        return store

    # -- transformers Cache surface used by the models
    def update(self, key_states, value_states, layer_idx: int, kwargs: dict | None = None, *args, **kw):
        """Write this step's keys/values ``[1, kv_heads, T, d]`` into the pages; return them as given."""
        self._write(f"layers.{layer_idx}.key", key_states[0].transpose(0, 1))
        self._write(f"layers.{layer_idx}.value", value_states[0].transpose(0, 1))
        if kwargs is not None:
            kwargs["paged_batch"] = self
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("paged batch: positions are per sequence; the runner passes position_ids")

    # -- softmax attention (the kt_paged attention function)
    def attention(self, module, query, key, value, scaling, window):
        """``query [1, H, T, d]``, this step's ``key/value [1, kvH, T, d]``; returns ``[1, T, H, dv]``."""
        li = module.layer_idx
        k_store = self.pool.tensors[f"layers.{li}.key"]
        v_store = self.pool.tensors[f"layers.{li}.value"]
        dev = query.device
        H = query.shape[1]
        gqa = H != k_store.shape[1]
        out = query.new_empty(1, self.num_tokens, H, v_store.shape[-1])
        for b, (qi, _, _) in enumerate(self.decode):
            qi = self._on(("dec_q", b), qi, dev)
            read, mask = self._decode_keys(b, k_store.device, dev, window)
            q = query[0][:, qi].transpose(0, 1).unsqueeze(2)  # [N, H, 1, d]
            k = _rows(k_store, read).transpose(1, 2).to(dev)  # [N, kvH, L, d]
            v = _rows(v_store, read).transpose(1, 2).to(dev)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
            out[0, qi] = o[:, :, 0].to(out.dtype)
        flash = self._flash(module, query, k_store, v_store)
        for i, (s, t, past, slots) in enumerate(self.chunks):
            q = query[:, :, s : s + t]
            if flash is not None:  # the kernel the single-sequence routes take: the same bits
                flash_attention_paged(kernel_pool(), q, k_store, v_store, self.tables[i], self.pool.page_size, past,
                                      scaling, window or 0, out=out[0, s : s + t], bf16_pv=flash)
                continue
            # keys before the window of the chunk's first query are masked for every query: not read
            lo = 0 if window is None else max(0, past + 1 - window)
            if past == 0:
                k, v = key[:, :, s : s + t], value[:, :, s : s + t]
            else:
                rd = self._on(("slots", i, lo), slots[lo:], k_store.device)
                k = _rows(k_store, rd).transpose(0, 1).unsqueeze(0).to(dev)
                v = _rows(v_store, rd).transpose(0, 1).unsqueeze(0).to(dev)
            mask = self._chunk_mask(i, t, past, dev, window, lo)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                               enable_gqa=gqa)
            out[0, s : s + t] = o[0].transpose(0, 1).to(out.dtype)
        return out

    def _flash(self, module, query, k_store, v_store) -> bool | None:
        """The prompt flash kernel's P V mode (bf16?) when this layer's prompt chunks take it, as
        the single-sequence routes' ``kt_sdpa`` would (operators/cpu_attention.py's conditions),
        else None (transformers' sdpa over the gathered pages)."""
        if not self.prompt_flash or not self.chunks:
            return None
        from ..operators.cpu_attention import flash_mode

        D = query.shape[-1]
        if (query.device.type != "cpu" or query.dtype != torch.float32 or k_store.dtype != torch.float32
                or v_store.dtype != torch.float32 or k_store.device.type != "cpu" or v_store.shape != k_store.shape
                or query.stride(-1) != 1 or not (k_store.is_contiguous() and v_store.is_contiguous()) or D % 64 or D > 512 or query.shape[1] % k_store.shape[1] or not getattr(module, "is_causal", True)
                or getattr(module, "training", False) or getattr(module, "sinks", None) is not None
                or (torch.is_grad_enabled() and query.requires_grad)):
            return None
        return flash_mode()

    # -- MLA (KDeepseekV2Attention)
    def mla_attention(self, attn, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        """Write the latent ``c_kv [1,1,T,C]`` / rope key ``k_pe [1,1,T,R]`` rows, attend per sequence.

        fp32 on the CPU (where the tier serves the widths): single tokens, and chunks unless the rule
        says ``absorb_for_prefill: false``, on ``mla.latent_kernel_attention`` over the row's own
        slots -- the single-sequence routes' kernel, the same bits whatever the rows beside it, the
        chunk, or a prefix read from another request's pages.  Otherwise single tokens by absorbed
        attention over the latent (``W_UK`` into the query, ``W_UV`` after), all of them in one
        padded call; chunks on the CPU by ``mla.causal_prompt_attention`` over the gathered latent
        (the same bits whatever the chunk); elsewhere expanded per-head keys (or absorbed when the
        rule says ``absorb_for_prefill``), queries in pieces of the operator's ``chunk_size``.
        Returns ``[1, H, T, v_head_dim]``."""
        from ..operators.mla import (absorbed_attention, absorbed_decode_attention, build_chunk_mask,
                                     causal_prompt_attention, expand_latent, expanded_attention,
                                     latent_kernel_attention, latent_kernel_serves)

        li = attn.layer_idx
        lat = self._write(f"layers.{li}.latent", c_kv[0, 0])
        rk = self._write(f"layers.{li}.rope_key", k_pe[0, 0])
        dev = q_nope.device
        w_uk, w_uv = attn.absorb_weights(dev, lat.dtype)
        q_nope = q_nope.to(lat.dtype)
        q_pe = q_pe.to(rk.dtype)
        H = q_nope.shape[1]
        out = q_nope.new_empty(1, H, self.num_tokens, attn.v_head_dim)
        serves = latent_kernel_serves(lat.shape[1], rk.shape[1], q_nope, q_pe, lat, rk)
        dec_kernel = serves and attn.absorb_decode
        chunk_kernel = serves and attn.absorb_for_prefill is not False
        if dec_kernel or chunk_kernel:  # each row over its own slots (a block table of one-slot pages)
            w_uk_c, w_uv_t = attn.latent_weights()
        for qi, past, read in self.decode if dec_kernel else ():
            for j, (i, p) in enumerate(zip(qi.tolist(), past.tolist())):
                out[:, :, i:i + 1] = latent_kernel_attention(
                    q_nope[:, :, i:i + 1], q_pe[:, :, i:i + 1], lat, rk, w_uk_c, w_uv_t, p, attn.scaling,
                    table=read[j, : p + 1].contiguous(), page_size=1)
        for s, t, past, slots in self.chunks if chunk_kernel else ():
            out[:, :, s:s + t] = latent_kernel_attention(
                q_nope[:, :, s:s + t], q_pe[:, :, s:s + t], lat, rk, w_uk_c, w_uv_t, past, attn.scaling,
                table=slots[: past + t].to(torch.int64).contiguous(), page_size=1)
        for b, (qi, _, read) in enumerate(() if dec_kernel else self.decode):
            qi = self._on(("dec_q", b), qi, dev)
            read = self._on(("dec_read", b), read, lat.device)
            qn = q_nope[0][:, qi].transpose(0, 1).unsqueeze(2)  # [N, H, 1, nope]
            qp = q_pe[0][:, qi].transpose(0, 1).unsqueeze(2)
            c = _rows(lat, read).unsqueeze(1).to(dev)  # [N, 1, L, C]
            r = _rows(rk, read).unsqueeze(1).to(dev)
            mask = self._decode_mask(b, dev)
            if attn.absorb_decode:
                o = absorbed_decode_attention(qn, qp, c, r, w_uk, w_uv, attn.scaling, mask)
            else:
                kn, vv = expand_latent(c, w_uk, w_uv)
                o = expanded_attention(qn, qp, kn, r, vv, attn.scaling, mask)
            out[0, :, qi] = o[:, :, 0].transpose(0, 1).to(out.dtype)
        for i, (s, t, past, slots) in enumerate(() if chunk_kernel else self.chunks):
            L = past + t
            if past == 0:
                c, r = c_kv[:, :, s : s + t].to(lat.dtype), k_pe[:, :, s : s + t].to(rk.dtype)
            else:
                rd = self._on(("slots", i), slots, lat.device)
                c, r = _rows(lat, rd)[None, None].to(dev), _rows(rk, rd)[None, None].to(dev)
            qn, qp = q_nope[:, :, s : s + t], q_pe[:, :, s : s + t]
            if dev.type == "cpu":  # the single-sequence routes' prompt attention: the same bits, any chunk
                o = causal_prompt_attention(qn, qp, c, r, attn.kv_b_weight(dev, lat.dtype), H, attn.scaling, past,
                                            absorbed=bool(attn.absorb_for_prefill))
                out[:, :, s : s + t] = o.to(out.dtype)
                continue
            if not attn.absorb_for_prefill:
                kn_all, v_all = expand_latent(c, w_uk, w_uv)
            step = attn.chunk_size
            for a in range(0, t, step):
                b = min(a + step, t)
                hi = L - t + b  # keys past the piece are unseen (causal)
                mask = build_chunk_mask(None, a, b, hi, t, L)
                if attn.absorb_for_prefill:
                    o = absorbed_attention(qn[:, :, a:b], qp[:, :, a:b], c[:, :, :hi], r[:, :, :hi], w_uk, w_uv,
                                           attn.scaling, mask)
                else:
                    o = expanded_attention(qn[:, :, a:b], qp[:, :, a:b], kn_all[:, :, :hi], r[:, :, :hi],
                                           v_all[:, :, :hi], attn.scaling, mask)
                out[:, :, s + a : s + b] = o.to(out.dtype)
        return out


def _rows(store: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``store[index]`` for an index of any shape, by ``index_select`` on the flat index: CPU
    advanced indexing with a 2-D index was 100x slower with 2 threads (16 ms vs 23 us for 2k rows)."""
    return store.index_select(0, index.reshape(-1)).view(*index.shape, *store.shape[1:])


PAD_WASTE = 1.5  # a decode bucket reads at most this many times the keys its sequences hold


def _length_buckets(dec: list) -> list[list]:
    """Single-token sequences grouped so that padding each group to its longest costs little:
    sorted by length, a group grows while ``n * L_max <= PAD_WASTE * sum(L)``.  Equal lengths: one
    call; very unequal lengths: one call each (padded keys are real memory traffic on CPU)."""
    out, cur, total = [], [], 0
    for d in sorted(dec, key=lambda d: -d[1]):
        length = d[1] + 1
        if cur and (len(cur) + 1) * (cur[0][1] + 1) > PAD_WASTE * (total + length):
            out.append(cur)
            cur, total = [], 0
        cur.append(d)
        total += length
    if cur:
        out.append(cur)
    return out


def _slots(pages: list[int], n: int, page_size: int) -> torch.Tensor:
    """Pool rows of tokens ``0 .. n-1`` of a sequence with block table ``pages``."""
    need = math.ceil(n / page_size)
    base = torch.tensor(pages[:need], dtype=torch.long) * page_size
    return (base[:, None] + torch.arange(page_size)[None, :]).reshape(-1)[:n]


def paged_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers attention-interface function ``"kt_paged"`` (selected by ``BatchRunner.step``)."""
    batch = kwargs.get("paged_batch")
    if batch is None:
        raise RuntimeError(f"'{PAGED_ATTENTION}' attention runs only inside BatchRunner.step (no paged batch cache)")
    if softcap is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError(f"layer {module.layer_idx}: paged attention has no logit soft-capping or sinks")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return batch.attention(module, query, key, value, scaling, sliding_window), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)


_register_attention()


# ---------------------------------------------------------------------------------- the runner


class NotPageable(ValueError):
    """The model has a layer whose state the page pool cannot hold (linear attention, sinks ...)."""


@dataclass(frozen=True)
class _AttnLayer:
    index: int
    name: str
    module: torch.nn.Module
    mla: bool


def _attention_layers(model) -> list[_AttnLayer]:
    layers = []
    for name, mod in model.named_modules():
        if not name.endswith("self_attn") or not hasattr(mod, "layer_idx"):
            continue
        is_mla = hasattr(mod, "kv_lora_rank")
        if hasattr(mod, "indexer"):  # set on every DSA layer (None where it reuses the previous top-k)
            raise NotPageable(f"{name}: {type(mod).__name__} has a sparse-attention indexer (DeepSeek-V3.2 / GLM-5), "
                             f"whose key cache and top-k selection the paged attention does not compute")
        if is_mla and not hasattr(mod, "absorb_weights"):
            raise NotPageable(f"{name}: {type(mod).__name__} (MLA) has no paged path; inject KDeepseekV2Attention "
                             f"(the shipped DeepSeek rules do)")
        if getattr(mod, "compressor", None) is not None:  # DeepSeek-V4's CSA / HCA layers
            raise NotPageable(f"{name}: {type(mod).__name__} compresses its KV (DeepSeek-V4 CSA / HCA), whose "
                             f"compressor state and compressed entries the paged attention does not hold")
        if getattr(mod, "sinks", None) is not None:
            raise NotPageable(f"{name}: {type(mod).__name__} has attention sinks (gpt-oss), which the paged "
                             f"attention does not compute")
        if not is_mla and not (hasattr(mod, "k_proj") and hasattr(mod, "head_dim")):
            raise NotPageable(f"{name}: {type(mod).__name__} has no paged cache layout "
                             f"(softmax attention with k_proj/v_proj, or MLA, only)")
        layers.append(_AttnLayer(int(mod.layer_idx), name, mod, is_mla))
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = int(cfg.num_hidden_layers)
    if sorted(la.index for la in layers) != list(range(n)):
        have = sorted(la.index for la in layers)
        raise NotPageable(f"{type(model).__name__}: paged batching needs an attention layer per decoder layer "
                         f"(found layer ids {have[:8]} of {n}; linear-attention / state layers are not paged)")
    return sorted(layers, key=lambda la: la.index)


def _layout(layers: list[_AttnLayer], dtype: torch.dtype) -> dict[str, PageTensor]:
    out = {}
    for la in layers:
        m, dev, i = la.module, module_device(la.module), la.index
        if la.mla:
            out[f"layers.{i}.latent"] = PageTensor((int(m.kv_lora_rank),), dtype, dev)
            out[f"layers.{i}.rope_key"] = PageTensor((int(m.qk_rope_head_dim),), dtype, dev)
        else:
            kvh = int(m.config.num_key_value_heads)
            hd = int(m.head_dim)
            out[f"layers.{i}.key"] = PageTensor((kvh, hd), dtype, dev)
            out[f"layers.{i}.value"] = PageTensor((kvh, hd), dtype, dev)
    return out


class BatchRunner:
    """Batched forward of many sequences over a shared ``PagePool`` (one runner per model).

    * ``begin(seq_id, prefix_pages=(), prefix_len=0)``: a new, empty sequence, or one whose first
      ``prefix_len`` tokens (a multiple of ``page_size``, ``len(prefix_pages) == prefix_len //
      page_size``) are already in ``prefix_pages`` (another sequence's or the prefix cache's).
      The runner increfs each prefix page and never writes into it (all later tokens go to pages it
      allocates itself); the caller's own references are untouched.
    * ``step(chunks, prompt, images)``: ONE forward for ``[(seq_id, new_token_ids), ...]`` (each seq at most once,
      ``len >= 1``; a prefill chunk or one decode token); appends the tokens to their sequences and
      returns fp32 logits of each chunk's last token, ``[len(chunks), vocab]``, in chunk order, on
      the device of the model's head.  It
      takes ``sum(pages_needed)`` pages with ``pool.reserve`` first: ``OutOfPages`` (or a bad chunk,
      ``ValueError``/``KeyError``) is raised before any state changed; an error inside the forward
      gives the new pages back and leaves the sequences as they were.
      ``images`` (``{seq_id: VisionInputs}``, multimodal/prompt.py): a vision-language model's prompt
      with pictures, read whole (from its first token, or from the end of a cached start given to
      ``begin``) as the only chunk of its step, by the model's own forward with the pictures; its
      later tokens take M-RoPE positions shifted by the pictures' offset, in any step.
    * ``pages_needed(seq_id, n_new)``: pages a step appending ``n_new`` tokens would allocate.
    * ``seq_len`` / ``seq_pages``: tokens held / block table (prefix pages first).
    * ``release(seq_id)``: decref every page of the sequence at once and forget it.

    During ``step`` the model's attention implementation is ``"kt_paged"``; it is restored after, so
    ``model.generate`` and the single-request path are untouched (do not run both at the same time).

    Decoding rows (one token each) take the model's one decode step (``generation/decode_step.py``,
    ``DecodeStep.step_pages``) where it serves the model: the bits the single-sequence ``Generator``
    gets for the same request, without the generic forward's per-layer dispatch;
    ``lean_decode = False`` (or ``KT_LEAN_DECODE=0`` in the environment at construction) keeps every
    step on the generic forward.
    """

    def __init__(self, model, *, page_size: int, num_pages: int, dtype: torch.dtype | None = None):
        self.model = model
        self.layers = _attention_layers(model)
        if dtype is None:
            dtype = getattr(model, "dtype", None) or torch.float32
        self.pool = PagePool(page_size, num_pages, _layout(self.layers, dtype))
        self.page_size = self.pool.page_size
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(cfg.vocab_size)
        self._configs = list({id(c): c for c in [model.config] + [la.module.config for la in self.layers
                                                                  if hasattr(la.module, "config")]}.values())
        self._seqs: dict[int, _Seq] = {}
        self.lean_decode = os.environ.get("KT_LEAN_DECODE", "1") != "0"

    # -- sequences
    def _seq(self, seq_id: int) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"sequence {seq_id!r} was not begun (or was released)")
        return s

    def begin(self, seq_id: int, prefix_pages: Iterable[int] = (), prefix_len: int = 0) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        pages = [int(p) for p in prefix_pages]
        S = self.page_size
        if prefix_len < 0 or prefix_len % S or len(pages) != prefix_len // S:
            raise ValueError(f"begin({seq_id!r}): prefix_len {prefix_len} must be a multiple of page_size {S} "
                             f"covered exactly by prefix_pages ({len(pages)} given)")
        for p in pages:
            if self.pool.refcount(p) == 0:
                raise ValueError(f"begin({seq_id!r}): prefix page {p} is free (its holder released it)")
        for p in pages:
            self.pool.incref(p)
        self._seqs[seq_id] = _Seq(pages=pages, length=prefix_len, shared=len(pages))

    def pages_needed(self, seq_id: int, n_new: int) -> int:
        s = self._seq(seq_id)
        return max(0, math.ceil((s.length + int(n_new)) / self.page_size) - len(s.pages))

    def seq_len(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def seq_pages(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).pages)

    def release(self, seq_id: int) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise KeyError(f"sequence {seq_id!r} was not begun (or was already released)")
        for p in s.pages:
            self.pool.decref(p)

    def sequences(self) -> list[int]:
        return list(self._seqs)

    # -- the step
    def _check_chunks(self, chunks) -> list[tuple[int, list[int]]]:
        seen, out = set(), []
        for item in chunks:
            seq_id, toks = item
            self._seq(seq_id)
            if seq_id in seen:
                raise ValueError(f"sequence {seq_id!r} appears twice in one step")
            seen.add(seq_id)
            toks = [int(t) for t in toks]
            if not toks:
                raise ValueError(f"sequence {seq_id!r}: a step chunk needs at least one token")
            bad = [t for t in toks if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"sequence {seq_id!r}: token id {bad[0]} outside the vocabulary 0..{self.vocab_size - 1}")
            out.append((seq_id, toks))
        return out

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]], prompt=(), images=None) -> torch.Tensor:
        """Logits of each chunk's last token.  ``prompt``: ids of the sequences whose chunk is prompt
        tokens; such a chunk is read by the prompt forward even when it is one token, so a prompt's
        cache is the same bits whatever the chunking (a one-token chunk of another sequence is a
        decoding row).  ``images``: ``{seq_id: VisionInputs}`` of a whole prompt with pictures (the
        rest of it after a cached start)."""
        chunks = self._check_chunks(chunks)
        images = dict(images or {})
        is_prompt = [sid in prompt or sid in images for sid, _ in chunks]
        if not chunks:
            return torch.empty(0, self.vocab_size)
        if images:
            sid = chunks[0][0]
            if len(chunks) != 1 or set(images) != {sid}:
                raise ValueError("a prompt with images is read whole, from its first token or its cached start, as "
                                 f"the only chunk of its step (got chunks of {[c[0] for c in chunks]}, images of "
                                 f"{list(images)})")
        need = [self.pages_needed(sid, len(toks)) for sid, toks in chunks]
        fresh = self.pool.reserve(sum(need))
        delta = None
        try:
            tables, it = [], iter(fresh)
            for (sid, toks), n in zip(chunks, need):
                s = self._seqs[sid]
                tables.append((s.pages + [next(it) for _ in range(n)], s.length, len(toks)))
            shifted = any(self._seqs[sid].rope_delta for sid, _ in chunks)
            logits = None if (any(is_prompt) or shifted) else self._lean_step(chunks, tables)
            if logits is None and not shifted:
                logits = self._mixed_step(chunks, tables, is_prompt)
            if logits is None:
                batch = _PagedBatch(self.pool, tables, is_prompt)
                tokens = [t for _, toks in chunks for t in toks]
                if images:
                    logits, delta = self._image_forward(batch, tokens, images[chunks[0][0]], tables[0][1])
                else:
                    shift = [self._seqs[sid].rope_delta for sid, _ in chunks] if shifted else None
                    logits = self._forward(batch, tokens, shift)
        except BaseException:
            for p in fresh:
                self.pool.decref(p)
            raise
        for (sid, toks), (pages, past, t) in zip(chunks, tables):
            s = self._seqs[sid]
            s.pages, s.length = pages, past + t
            if delta is not None:
                s.rope_delta = delta
        return logits

    def _lean_step(self, chunks, tables) -> torch.Tensor | None:
        """Logits of a decode-only step by the model's decode step, or None (the generic forward)."""
        if not self.lean_decode or any(t != 1 for *_, t in tables) or getattr(self.model, "training", False):
            return None
        lean = decode_step_for(self.model)
        if lean is None or not lean.accepts_rows(len(tables)) or lean.pages_of(self.pool) is None:
            return None
        return lean.step_pages([toks[0] for _, toks in chunks], [past for _, past, _ in tables],
                               [pages for pages, _, _ in tables], self.pool)

    def _mixed_step(self, chunks, tables, is_prompt) -> torch.Tensor | None:
        """A step of decoding rows and prompt chunks: the decoding rows by the lean step, the chunks
        by the generic forward, so that a decoding row gets the bits of a decode-only step whatever
        prompt is read beside it (batch invariance); None when the lean step does not serve them."""
        dec = [i for i, (*_, t) in enumerate(tables) if t == 1 and not is_prompt[i]]
        if not dec or len(dec) == len(tables):
            return None
        lean = self._lean_step([chunks[i] for i in dec], [tables[i] for i in dec])
        if lean is None:
            return None
        rest = [i for i in range(len(tables)) if i not in dec]
        batch = _PagedBatch(self.pool, [tables[i] for i in rest], [is_prompt[i] for i in rest])
        other = self._forward(batch, [t for i in rest for t in chunks[i][1]])
        out = torch.empty(len(tables), other.shape[-1], dtype=other.dtype, device=other.device)
        out[dec] = lean.to(out.device, out.dtype)
        out[rest] = other
        return out

    def _image_forward(self, batch: _PagedBatch, tokens: list[int], vision, past: int) -> tuple[torch.Tensor, int]:
        """(logits, M-RoPE shift) of a prompt with pictures from cache row ``past`` on: the model's
        own forward with them, at the positions of its ``get_rope_index`` over the whole prompt
        (multimodal/prompt.py)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=module_device(self.model.get_input_embeddings()))
        kwargs, delta = vision.batch_kwargs(self.model, ids, past)
        return self._forward(batch, tokens, position_ids=kwargs.pop("position_ids"), extra=kwargs), delta

    def _forward(self, batch: _PagedBatch, tokens: list[int], shift: list[int] | None = None, *,
                 position_ids: torch.Tensor | None = None, extra: dict | None = None) -> torch.Tensor:
        """``shift``: per chunk, the M-RoPE shift of a sequence whose prompt had pictures (positions
        [4, 1, T]: the cache row, then t / h / w moved by the shift; text-only rows move by 0)."""
        emb = self.model.get_input_embeddings()
        dev = module_device(emb)
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        if position_ids is None:
            position_ids = batch.position_ids
            if shift is not None:
                sizes = torch.diff(batch.last_index, prepend=torch.tensor([-1]))  # tokens per chunk
                per_token = torch.repeat_interleave(torch.tensor(shift), sizes)
                position_ids = torch.cat([position_ids[None], (position_ids + per_token)[None].expand(3, 1, -1)])
        saved = [c._attn_implementation for c in self._configs]
        from ..operators.cpu_attention import NAME as KT_SDPA

        batch.prompt_flash = KT_SDPA in saved
        for c in self._configs:
            c._attn_implementation = PAGED_ATTENTION
        try:
            out = self.model(input_ids=ids, position_ids=position_ids.to(dev), cache=batch, use_cache=True,
                             logits_to_keep=batch.last_index, **(extra or {}))
        finally:
            for c, v in zip(self._configs, saved):
                c._attn_implementation = v
        logits = out.logits[0]
        if logits.shape[0] != batch.last_index.numel():  # a model that ignores logits_to_keep
            logits = logits[batch.last_index.to(logits.device)]
        return logits.float()


__all__ = ["BatchRunner", "OutOfPages", "PagePool", "PageTensor", "PAGED_ATTENTION", "paged_attention_forward"]
