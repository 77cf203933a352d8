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

Assisted decoding (``generate(prompt_lookup_num_tokens=k)``, ``generate(assistant_model=...)``):
its verify forward (the pending token and the guesses over a cache that holds the sequence, every
row's logits asked for: ``logits_to_keep`` = the number of tokens) is answered by the step's
``step_rows``, the rows the ``Generator``'s verify runs; its first forward (the prompt and the
first guesses on an empty cache) by the model's forward of the prompt alone and the guesses as
verify rows.  transformers' ``cache.crop`` of the rejected rows is then the step's own undo (a
static layer's counter, a dynamic layer's shorter view of the same buffer), so greedy assisted
decoding gives plain greedy ``generate()``'s tokens and logits bit for bit.
"""

from __future__ import annotations

import functools
import os

import torch

#: forward arguments the step answers for; any other (or an unusual value of these) -> the model
_STEP_ARGS = frozenset({"input_ids", "cache", "past_key_values", "position_ids", "cache_position",
                        "attention_mask", "logits_to_keep", "use_cache", "return_dict",
                        "output_attentions", "output_hidden_states"})


def _lean_call(model, kwargs, own=None):
    """Logits [1, n, V] from the lean step for this forward call, or None (the model runs it)."""
    ids = kwargs.get("input_ids")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if (cache is None or ids is None or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1
            or not _STEP_ARGS.issuperset(kwargs)
            or kwargs.get("output_attentions") or kwargs.get("output_hidden_states")
            or kwargs.get("use_cache") is False or kwargs.get("return_dict") is False or model.training
            or ids.device.type != "cpu"):
        return None
    n = int(ids.shape[1])
    keep = kwargs.get("logits_to_keep")
    if n > 1:
        # several tokens: only transformers' assisted decoding's verify forward (all n rows' logits
        # asked for, ``logits_to_keep=n``, over a cache that holds the sequence) or its first
        # forward (the prompt and the first guesses on an empty cache, ``1 < logits_to_keep <= n``);
        # a prompt, a chunk of one or a plain multi-token forward stays the model's own
        if type(keep) is not int or not 1 < keep <= n:
            return None
    from .decode_step import decode_step_for

    step = decode_step_for(model)
    if step is None:
        return None
    if n > 1 and int(cache.get_seq_length()) == 0:  # (a prompt of one token: logits_to_keep == n)
        return _first_assisted(model, step, kwargs, own, n, keep) if own is not None else None
    if n > 1 and keep != n or not step.accepts(cache):
        return None
    pos = cache.get_seq_length()
    pos = int(pos)
    if n > 1:
        return _verify(step, kwargs, cache, pos, n)
    for name in ("position_ids", "cache_position"):
        p = kwargs.get(name)
        if p is not None and (p.numel() != 1 or int(p.reshape(-1)[0]) != pos):
            return None
    if not _plain_mask(kwargs.get("attention_mask"), step, cache, pos):
        return None  # padding, or a mask the step cannot read: the model's own forward reads it
    logits = step.step(int(ids[0, 0]), pos, cache)
    return None if logits is None else logits.view(1, 1, -1).clone()


def _positions_are(kwargs, start: int, n: int) -> bool:
    """Whether the call's ``position_ids`` / ``cache_position`` (where given) are ``start .. start + n - 1``."""
    want = torch.arange(start, start + n)
    for name in ("position_ids", "cache_position"):
        p = kwargs.get(name)
        if p is not None and (p.numel() != n or not torch.equal(p.reshape(-1).to("cpu", torch.int64), want)):
            return False
    return True


def _verify(step, kwargs, cache, pos: int, n: int):
    """Assisted decoding's verify forward: the pending token and the guesses as rows of one
    ``step_rows`` (the rows the Generator's verify runs: row r has the bits of a plain step after
    the rows before it).  The cache ends holding all n rows, as the model's forward leaves it;
    transformers then crops the rejected ones (``cache.crop``), which on the layers the step
    serves is the step's own undo: a static layer's counter moves back and the next row overwrites
    the stale entries, a dynamic layer's keys / values become the shorter view of the same buffer."""
    if not step.accepts_rows(n) or not _positions_are(kwargs, pos, n):
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # keep flags over the sequence and the rows
        if tuple(mask.shape) != (1, pos + n) or not bool((mask != 0).all()):
            return None
    elif mask is not None and not all(_plain_mask(_row(mask, r, n), step, cache, pos, r) for r in range(n)):
        return None
    got = step.step_rows([int(t) for t in kwargs["input_ids"][0].tolist()], pos, cache)
    if got is None:
        return None
    return got[0].view(1, n, -1).clone()


def _row(mask, r: int, n: int):
    """Row ``r`` of an n-query mask, shaped as a one-query mask (2-D keep flags stay as they are)."""
    if isinstance(mask, dict):
        return {k: _row(v, r, n) for k, v in mask.items()}
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[2] == n:
        return mask[:, :, r:r + 1]
    return mask


def _first_assisted(model, step, kwargs, own, n: int, keep: int):
    """Assisted decoding's first forward, the prompt and ``keep - 1`` guesses on an empty cache:
    the prompt as plain ``generate()`` reads it (the model's own forward of the prompt alone, its
    last row's logits), then the guesses as verify rows of the step, so every row has the bits of
    plain greedy decoding.  None (the model runs the whole call) where the inputs are not the plain
    ones (a padded mask, positions that are not 0 .. n - 1), the cache is not empty or has sliding
    layers."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if (int(cache.get_seq_length()) != 0 or not step.accepts_rows(keep - 1) or not _positions_are(kwargs, 0, n)
            or any(getattr(cl, "is_sliding", False) for cl in getattr(cache, "layers", ()))):
        return None  # (sliding layers: the step does not verify on them under assisted decoding)
    p = n - keep + 1  # the prompt's length
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if tuple(mask.shape) != (1, n) or not bool((mask != 0).all()):
            return None
    elif mask is not None and _row(mask, 0, n) is mask:
        return None  # a mask whose rows are not the queries'
    first = dict(kwargs)
    first["input_ids"] = kwargs["input_ids"][:, :p]
    first["logits_to_keep"] = 1
    for name in ("position_ids", "cache_position"):
        if kwargs.get(name) is not None:
            first[name] = kwargs[name].reshape(-1)[:p].reshape(*kwargs[name].shape[:-1], p)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        first["attention_mask"] = mask[:, :p]
    elif mask is not None:
        first["attention_mask"] = ({k: v[:, :, :p] for k, v in mask.items()} if isinstance(mask, dict)
                                   else mask[:, :, :p])
    out = own(**first)
    rest = {k: v for k, v in kwargs.items() if k != "input_ids"}
    rest["input_ids"] = kwargs["input_ids"][:, p:]
    rest["logits_to_keep"] = keep - 1
    for name in ("position_ids", "cache_position"):
        if kwargs.get(name) is not None:
            rest[name] = kwargs[name].reshape(-1)[p:].reshape(*kwargs[name].shape[:-1], keep - 1)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        rest["attention_mask"] = mask
    elif mask is not None:
        rest["attention_mask"] = ({k: v[:, :, p:] for k, v in mask.items()} if isinstance(mask, dict)
                                  else mask[:, :, p:])
    tail = _lean_call(model, rest) if step.accepts(cache) else None
    if tail is None:  # the step does not take this cache: the model's own forward of the guesses
        tail = own(**rest).logits
    return torch.cat([out.logits[:, -1:].to(tail.dtype), tail[:, -(keep - 1):]], dim=1)


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Of a 4-D attention mask: bool masks keep True, additive (float) ones add 0."""
    return mask if mask.dtype is torch.bool else mask == 0


def _plain_mask(mask, step, cache, pos: int, r: int = 0) -> bool:
    """Whether ``mask`` lets the query see exactly what the step attends to: none, a 2-D mask of
    ones over the positions so far, or (static caches under ``generate()``) a ``[1, 1, 1, S]`` mask
    (one for all layers, or one per layer type) showing the first n entries of each layer's cache
    and none after.  ``r``: the query is row r of a verify step at ``pos`` (it sees r more entries,
    and a sliding window must not have rolled)."""
    if mask is None:
        return True
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # keep flags: 1 (or True) = a real token
        return tuple(mask.shape) == (1, pos + 1) and bool((mask != 0).all())
    seen = step.attended(cache, pos)
    if r:
        caps = {lay.layer_type: int(getattr(cl, "max_cache_len", 1 << 62))
                for lay, cl in zip(step.layers, cache.layers) if getattr(cl, "is_sliding", False)}
        if any(seen[lt] + r > cap for lt, cap in caps.items()):
            return False  # the window rolled within the step: leave the call to the model
        seen = {lt: v + r for lt, v in seen.items()}
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
            logits = _lean_call(model, kwargs, own)
            if logits is not None:
                return CausalLMOutputWithPast(logits=logits, cache=kwargs.get("cache", kwargs.get("past_key_values")))
        return own(*args, **kwargs)

    model.forward = forward
    model.__dict__["_kt_lean_forward"] = own


__all__ = ["use_lean_generate"]
