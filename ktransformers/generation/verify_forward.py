"""Speculative verify through the model's own forward, for models the decode step does not serve.

Qwen3-Next and Qwen3.5 (gated-DeltaNet layers beside full attention) decode through their
injected forward, one token a call.  That forward is chunk-invariant (the DeltaNet layers token by
token in C++, operators/cpu_linear_attention.py; the attention on the flash kernel; every linear
and MoE row alone): the ``n`` rows of one call give the bits of ``n`` one-token calls.  So guesses
are verified as one call of ``n`` rows, all their logits kept, and ``undo(kept)`` leaves the cache
as if only the first ``kept`` rows had been read: the full-attention layers' counters cut back (the
stale entries past them are overwritten by the next write), each DeltaNet layer's conv window cut
there and its recurrent state replayed over the kept rows from the state before the call.
"""

from __future__ import annotations

import torch


def _attention_layers(cache):
    """The cache's full-attention static layers, or None when a layer is of a kind this undo does
    not know (sliding windows, dynamic layers, hybrids)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticLayer, StaticSlidingWindowLayer

    out = []
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if isinstance(layer, StaticLayer):
                return None  # a layer of both kinds
            continue
        if type(layer) is not StaticLayer or isinstance(layer, StaticSlidingWindowLayer):
            return None
        out.append(layer)
    return out


def forward_verifies(model, cache=None) -> bool:
    """Whether ``model``'s forward can verify guesses (with ``cache``, when given): a model with
    DeltaNet layers, all on the token-by-token forward."""
    from ..operators.cpu_linear_attention import fast_path_takes

    if cache is not None and _attention_layers(cache) is None:
        return False
    return fast_path_takes(model, cache)


def forward_rows(model, rows: list[int], pos: int, cache, device="cpu"):
    """``(logits [n, vocab] fp32, undo)`` of the tokens ``rows`` at positions ``pos ..`` read in one
    call of the model's forward (its inputs on ``device``), or None where the model or cache does
    not take it (nothing run)."""
    from ..operators.cpu_linear_attention import deltanet_layers, recording, undo_rows

    attn = _attention_layers(cache)
    if attn is None or not forward_verifies(model, cache):
        return None
    n = len(rows)
    for layer in attn:
        if getattr(layer, "is_initialized", False) and (int(layer.cumulative_length) != pos
                                                        or pos + n > layer.max_cache_len):
            return None
    ids = torch.tensor([rows], dtype=torch.long, device=device)
    positions = torch.arange(pos, pos + n, device=device).unsqueeze(0)
    forward = model.__dict__.get("_kt_lean_forward") or model
    with recording(model) as records:
        out = forward(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=0)
    if len(records) != len(deltanet_layers(model)):  # a layer took transformers' forward after all
        raise RuntimeError("speculative verify: a DeltaNet layer left the token-by-token forward during the "
                           "verify, so its state cannot be rolled back (KT_FAST_DELTANET=0 decodes plainly)")
    logits = out.logits[0, -n:].float()

    def undo(kept: int) -> None:
        drop = n - int(kept)
        if drop <= 0:
            return
        for layer in attn:
            layer.crop(-drop)
        undo_rows(records, cache, int(kept))

    return logits, undo


__all__ = ["forward_rows", "forward_verifies"]
