"""Gated-DeltaNet linear attention (Qwen3-Next, Qwen3.5) on the CPU, token by token in C++.

transformers' DeltaNet forward reads a prompt with its chunked gated delta rule: 64-token chunks
counted from wherever the call starts, matmuls and triangular solves over each, and the one-token
recurrent form for decode.  The same prompt read whole, in chunks of another size, after a cached
prefix, or continued by decode steps therefore gives other sums, other bits -- and another greedy
answer at a near tie.  Here the conv and the delta rule run token by token
(``kernels.attention.causal_conv_silu`` / ``gated_delta_rule``: the recurrent form's math, every
token the same operations in the same order), so every chunking leaves the same state and logits.
Speed: faster than transformers' torch code on the CPU (``bench/linear_attention.py``, Qwen3-Next's
shape, 2 threads: 1.9-3.4x on a prompt of 512-4096 tokens, 4.7x for a decode token).

The projections, the gated RMSNorm and the output projection are the module's own (on whatever
ops the rules put there).  The conv and recurrent states stay in transformers' cache in its own
layout, so ``generate()`` and every other reader of the cache see what they expect.  The fast
path takes one sequence of fp32 CPU activations under no gradient, in eval mode, with a SiLU conv
without bias and no padding mask; anything else (training, batches, bf16 models, a cache that
records its past for speculative rollback) and ``KT_FAST_DELTANET=0`` run transformers' forward.

Speculative verify (generation/verify_forward.py): under ``recording(model)`` each layer's call also
keeps what undoing its rows needs -- the conv window it read, the recurrent state before the call
and the delta rule's inputs -- and ``undo_rows`` puts a layer back as if only its first ``kept``
rows had been read (the window cut there, the state replayed over those rows: the same bits, since
the rule runs token by token).
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
import torch.nn.functional as F

from ..kernels.attention import causal_conv_silu, gated_delta_rule
from .cpu_threads import kernel_pool

_FUSED = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")  # Qwen3-Next
_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5
_COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "layer_idx", "head_k_dim", "head_v_dim",
           "num_k_heads", "num_v_heads", "conv_kernel_size", "activation", "key_dim", "value_dim")


def _recognised(mod) -> bool:
    """Whether ``mod`` is a DeltaNet layer of a layout this forward knows."""
    if not type(mod).__name__.endswith("GatedDeltaNet") or not all(hasattr(mod, a) for a in _COMMON):
        return False
    return all(hasattr(mod, a) for a in _FUSED) or all(hasattr(mod, a) for a in _SPLIT)


def _projections(self, hidden_states):
    """(qkv ``[T, C]``, z ``[T, hv, dv]``, b ``[T, hv]``, a ``[T, hv]``) of one sequence, as the
    module's own forward computes them."""
    if hasattr(self, "in_proj_qkvz"):
        query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                       self.in_proj_ba(hidden_states))
        qkv = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value)], dim=-1)
    else:
        qkv = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states).reshape(1, hidden_states.shape[1], -1, self.head_v_dim)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    return qkv[0], z[0], b[0], a[0]


def _eligible(self, x, cache, attention_mask, kwargs) -> bool:
    if (self.training or x.dim() != 3 or x.shape[0] != 1 or x.shape[1] < 1 or x.device.type != "cpu"
            or x.dtype != torch.float32 or str(self.activation) not in ("silu", "swish")
            or self.conv1d.bias is not None or self.conv1d.weight.dtype != torch.float32
            or self.A_log.dtype != torch.float32 or self.dt_bias.dtype != torch.float32
            or kwargs.get("cu_seq_lens_q") is not None or os.environ.get("KT_FAST_DELTANET", "1") == "0"
            or (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())))):
        return False
    if attention_mask is not None and not bool(attention_mask.all()):
        return False  # padding: transformers' forward zeroes the padded rows
    if cache is not None:
        if not all(hasattr(cache, f) for f in ("get_conv_state", "update_conv_state", "get_recurrent_state",
                                               "update_recurrent_state")):
            return False
        if getattr(cache, "is_recording_past", None) is not None and cache.is_recording_past(self.layer_idx):
            return False
    return True


def _fast_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    if cache is None and "cache_params" in kwargs:
        cache = kwargs.pop("cache_params")
    if not _eligible(self, hidden_states, cache, attention_mask, kwargs):
        return self._kt_original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    T = hidden_states.shape[1]
    K = int(self.conv_kernel_size)
    # the state before this chunk (None: the sequence starts here), read before the conv state is written
    prev = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
    qkv, z, b, a = _projections(self, hidden_states)
    x = qkv.transpose(0, 1)  # [C, T]: the cache keeps the conv window channel-major
    if cache is not None:
        x = cache.update_conv_state(x[None], self.layer_idx, conv_kernel_size=K)[0]
    if x.shape[1] < T + K - 1:  # the sequence's first inputs: zeros before them
        x = F.pad(x, (T + K - 1 - x.shape[1], 0))
    pool = kernel_pool()
    w = self.conv1d.weight.detach().reshape(self.conv1d.weight.shape[0], -1).contiguous()
    qkv = causal_conv_silu(pool, x.contiguous(), w, T)
    hv, dk, dv = self.num_v_heads, self.head_k_dim, self.head_v_dim
    if prev is not None and prev.dtype == torch.float32 and prev.is_contiguous() and prev.shape == (1, hv, dk, dv):
        state = prev[0]  # updated in place: the cache's own tensor
    else:
        state = torch.zeros(hv, dk, dv) if prev is None else prev[0].float().contiguous()
        prev = None
    b, a = b.float().contiguous(), a.float().contiguous()
    record = self.__dict__.get("_kt_record")
    if record is not None:  # a speculative verify: what undoing some of these rows needs
        record.append(_Rows(self, x, state.clone(), qkv, b, a))
    out = gated_delta_rule(pool, qkv, b, a, self.A_log.detach().contiguous(), self.dt_bias.detach().contiguous(),
                           state, self.num_k_heads, dk)
    if cache is not None and prev is None:
        cache.update_recurrent_state(state[None], self.layer_idx)
    out = self.norm(out.reshape(-1, dv), z.reshape(-1, dv))
    return self.out_proj(out.reshape(1, T, -1))


class _Rows:
    """One layer's call under ``recording``: ``window`` the conv inputs it read ``[C, W + T]``
    (the cached window of ``W``, then the call's rows), ``state`` the recurrent state before it, and the
    delta rule's inputs (``qkv`` after the conv, ``b``, ``a``)."""

    def __init__(self, mod, window, state, qkv, b, a):
        self.mod, self.window, self.state, self.qkv, self.b, self.a = mod, window, state, qkv, b, a


def deltanet_layers(model) -> list:
    """The model's gated-DeltaNet layers (any forward)."""
    return [m for m in model.modules() if _recognised(m)]


def fast_path_takes(model, cache) -> bool:
    """Whether every DeltaNet layer of ``model`` takes one sequence of its activations on the
    token-by-token forward with ``cache`` (what a speculative verify's undo needs)."""
    layers = deltanet_layers(model)
    if not layers:
        return False
    emb = model.get_input_embeddings()
    probe = torch.empty(1, 1, 1, dtype=getattr(getattr(emb, "weight", None), "dtype", torch.float32))
    return all(hasattr(m, "_kt_original_forward") and _eligible(m, probe, cache, None, {}) for m in layers)


@contextlib.contextmanager
def recording(model):
    """Within it, every DeltaNet layer's fast forward records its rows; yields the records (a list,
    in call order)."""
    layers = deltanet_layers(model)
    records: list[_Rows] = []
    for m in layers:
        m._kt_record = records
    try:
        yield records
    finally:
        for m in layers:
            m.__dict__.pop("_kt_record", None)


def undo_rows(records, cache, kept: int) -> None:
    """Put each recorded layer's cache back as if only the first ``kept`` rows of its call had been
    read: the cached conv window ends before row ``kept``, the recurrent state the one
    before the call with the delta rule run again over those rows."""
    pool = kernel_pool()
    for r in records:
        mod = r.mod
        K = int(mod.conv_kernel_size)
        T = r.qkv.shape[0]
        if kept >= T:
            continue
        layer = cache.layers[mod.layer_idx]
        conv = layer.conv_states[0]
        width = conv.shape[-1]  # the cache keeps the last ``width`` inputs (the kernel size)
        end = r.window.shape[1] - (T - kept)
        win = r.window[:, max(0, end - width):end]
        if win.shape[1] < width:  # the sequence's first inputs: zeros before them
            win = F.pad(win, (width - win.shape[1], 0))
        conv.copy_(win.to(conv.dtype)[None])
        state = r.state.clone()
        if kept:
            gated_delta_rule(pool, r.qkv[:kept].contiguous(), r.b[:kept].contiguous(), r.a[:kept].contiguous(),
                             mod.A_log.detach().contiguous(), mod.dt_bias.detach().contiguous(), state,
                             mod.num_k_heads, int(mod.head_k_dim))
        layer.recurrent_states[0].copy_(state[None].to(layer.recurrent_states[0].dtype))


def use_cpu_linear_attention(model) -> int:
    """Give every gated-DeltaNet layer of ``model`` the token-by-token CPU forward (idempotent);
    returns how many were switched."""
    n = 0
    for mod in model.modules():
        if hasattr(mod, "_kt_original_forward") or not _recognised(mod):
            continue
        mod._kt_original_forward = mod.forward
        mod.forward = types.MethodType(_fast_forward, mod)
        n += 1
    return n


__all__ = ["deltanet_layers", "fast_path_takes", "recording", "undo_rows", "use_cpu_linear_attention"]
