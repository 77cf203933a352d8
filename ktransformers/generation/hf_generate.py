"""transformers' own ``generate()`` on the lean decode step.

A user who injects a model into their own script calls ``model.generate(...)``, whose decode loop
calls ``model(input_ids=[[t]], cache=..., position_ids=...)`` once per token: the generic forward,
~2x slower per token than the step ``local_chat`` takes.  :func:`use_lean_generate` puts that same
step (:mod:`.decode_step`) under the model's ``forward``: a call that is one token of one sequence
on a cache the step serves (static or dynamic), with nothing asked of the forward but the logits,
is answered by the step; every other call (the prompt, batches, ``output_attentions``, a padded
mask, training, ``KT_LEAN_DECODE=0``) goes to the model's own forward, unchanged.  Sampling,
stopping and streaming stay transformers' own.  The prompt forward and the step are the ones the
``Generator`` runs, so greedy tokens are the same as local_chat's.
"""

from __future__ import annotations

import functools
import os

import torch

#: forward arguments the step answers for; any other (or an unusual value of these) -> the model
_STEP_ARGS = frozenset({"input_ids", "cache", "past_key_values", "position_ids", "cache_position",
                        "attention_mask", "logits_to_keep", "use_cache", "return_dict",
                        "output_attentions", "output_hidden_states"})


def _lean_call(model, kwargs):
    """Logits [1, 1, V] from the lean step for this forward call, or None (the model runs it)."""
    ids = kwargs.get("input_ids")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if (cache is None or ids is None or tuple(ids.shape) != (1, 1) or not _STEP_ARGS.issuperset(kwargs)
            or kwargs.get("output_attentions") or kwargs.get("output_hidden_states")
            or kwargs.get("use_cache") is False or kwargs.get("return_dict") is False or model.training
            or ids.device.type != "cpu"):
        return None
    from .decode_step import decode_step_for

    step = decode_step_for(model)
    if step is None or not step.accepts(cache):
        return None
    pos = cache.get_seq_length()
    pos = int(pos)
    for name in ("position_ids", "cache_position"):
        p = kwargs.get(name)
        if p is not None and (p.numel() != 1 or int(p.reshape(-1)[0]) != pos):
            return None
    if not _plain_mask(kwargs.get("attention_mask"), step, cache, pos):
        return None  # padding, or a mask the step cannot read: the model's own forward reads it
    logits = step.step(int(ids[0, 0]), pos, cache)
    return None if logits is None else logits.view(1, 1, -1).clone()


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Of a 4-D attention mask: bool masks keep True, additive (float) ones add 0."""
    return mask if mask.dtype is torch.bool else mask == 0


def _plain_mask(mask, step, cache, pos: int) -> bool:
    """Whether ``mask`` lets the query see exactly what the step attends to: none, a 2-D mask of
    ones over the positions so far, or (static caches under ``generate()``) a ``[1, 1, 1, S]`` mask
    (one for all layers, or one per layer type) showing the first n entries of each layer's cache
    and none after."""
    if mask is None:
        return True
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # keep flags: 1 (or True) = a real token
        return tuple(mask.shape) == (1, pos + 1) and bool((mask != 0).all())
    seen = step.attended(cache, pos)
    if isinstance(mask, torch.Tensor):  # one mask for every layer (a model of one layer type)
        mask = {layer_type: mask for layer_type in seen}
    if not isinstance(mask, dict):
        return False
    for layer_type, n in seen.items():
        m = mask.get(layer_type)
        if m is None:
            continue
        if not isinstance(m, torch.Tensor) or m.dim() != 4 or m.shape[:3] != (1, 1, 1) or m.shape[-1] < n:
            return False
        v = _visible(m[0, 0, 0])
        if not bool(v[:n].all()) or bool(v[n:].any()):
            return False
    return True


def use_lean_generate(model) -> None:
    """Answer ``model``'s single-token forward calls with the lean decode step where it serves
    them (see the module docstring).  Idempotent; the step itself is built on the first such call."""
    if "_kt_lean_forward" in model.__dict__:
        return
    from transformers.modeling_outputs import CausalLMOutputWithPast

    own = model.forward

    @functools.wraps(own)
    def forward(*args, **kwargs):
        if not args and os.environ.get("KT_LEAN_DECODE", "1") != "0":
            logits = _lean_call(model, kwargs)
            if logits is not None:
                return CausalLMOutputWithPast(logits=logits, cache=kwargs.get("cache", kwargs.get("past_key_values")))
        return own(*args, **kwargs)

    model.forward = forward
    model.__dict__["_kt_lean_forward"] = own


__all__ = ["use_lean_generate"]
