"""Prompt attention on the CPU through the project's flash kernel: ``kt_sdpa``.

An ``AttentionInterface`` function that transformers' own attention modules call (Llama, Qwen,
Mixtral, GLM, Gemma ... every family whose attention is not swapped by a rule).  A prompt chunk of
one sequence on the CPU goes to :func:`ktransformers.kernels.flash_attention`: only the keys each
query sees, no ``T x S`` matrix, fp32 scores and sums, the probability x value product on bf16
pairs on AVX512-BF16 tiers (1.5-2.5x torch's CPU flash kernel, bench/attention.py), fp32 on AVX-512 without
BF16 and on AVX2.  ``KT_FLASH_ATTN=fp32`` keeps that
product in fp32 too (the default below AVX512-BF16: 0.95-1.7x torch's speed at 512-8192 tokens on
Ice Lake's AVX-512, bench/README.md; results within fp32 rounding of transformers').

Everything else goes to transformers' ``sdpa`` function unchanged: decode (one query: the lean
decode step or sdpa), training (the kernel has no backward, and a checkpointed forward must match
its recomputation), batches, CUDA tensors, attention sinks, soft-capping, a non-causal module,
tiers without AVX2 + FMA, ``KT_FLASH_ATTN=0``, and any mask that is not the causal (or
sliding-window) one for the positions given -- checked, not assumed.

Only models whose modeling code never branches on the implementation's name are switched (a few
transformers families, e.g. DeepSeek-V3.2's sparse indexer, behave differently for "sdpa").
"""

from __future__ import annotations

import inspect
import os
import re
import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from ..kernels.attention import flash_attention, flash_attention_supported, rope_prompt, same_kv_strides
from .cpu_threads import kernel_pool

NAME = "kt_sdpa"


def _start(kwargs, q_len: int) -> int | None:
    """First position of one sequence's contiguous chunk (``position_ids [1, T]``), or None."""
    pos = kwargs.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.shape != (1, q_len):
        return None
    start = int(pos[0, 0])
    if start < 0 or int(pos[0, -1]) != start + q_len - 1:
        return None
    if q_len > 2 and not bool((pos[0, 1:] - pos[0, :-1] == 1).all()):
        return None
    return start


def _visible(start: int, q_len: int, kv_len: int, window: int, first: int = 0) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (position start + i) sees key index j (position first + j) when
    first + j <= start + i (and > start + i - window)."""
    j = torch.arange(first, first + kv_len)[None, :]
    p = torch.arange(start, start + q_len)[:, None]
    m = j <= p
    return m & (j > p - window) if window else m


def flash_eligible(module, query, key, value, attention_mask, dropout, is_causal,
                   kwargs) -> tuple[int, int, int] | None:
    """``(start, window, key_first)`` when the call can take the flash kernel, else None."""
    B, H, T, D = query.shape
    if (B != 1 or T < 1 or dropout or is_causal is False or not getattr(module, "is_causal", True)
            or getattr(module, "training", False)
            or query.device.type != "cpu" or query.dtype != torch.float32 or key.dtype != torch.float32
            or value.dtype != torch.float32 or not same_kv_strides(key, value)
            or query.stride(3) != 1 or key.stride(3) != 1 or D % 64 or D > 512 or H % key.shape[1]
            or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("output_attentions") or _mode() == "0"
            or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            or not flash_attention_supported()):
        return None
    start = _start(kwargs, T)
    if start is None:
        return None
    window = int(kwargs.get("sliding_window") or 0)
    first = 0
    if start + T > key.shape[2]:
        # a sliding layer whose window rolled hands over its last keys and the chunk's: positions
        # start + T - S .. start + T - 1, every key a query sees among them (its mask says so)
        first = start + T - key.shape[2]
        if not window or attention_mask is None or first > start - window + 1:
            return None
    if window and attention_mask is None and not (start + T <= window and start + T <= key.shape[2]):
        # a sliding layer's cache may hold a rolled window: trust only its mask.  With none, sdpa
        # would attend causally from key 0: the kernel's reading while the window does not bind and
        # the layer has not rolled (a cache shorter than the window leaves transformers' mask out)
        return None
    if attention_mask is not None and not _plain_mask(attention_mask, start, T, window, first):
        return None
    return start, window, first


#: the last mask found plain: (the mask, its address / shape / strides, start, T, window).  A model's
#: forward builds one mask per layer type and hands the same tensor to each of its layers, so a
#: T x S check runs once per forward, not once per layer (85 ms a layer at 8192 tokens).
_last_plain: list = [None]


def _plain_mask(m: torch.Tensor, start: int, T: int, window: int, first: int = 0) -> bool:
    """Whether ``m`` ``[1, 1, T, S]`` (bool) is exactly the causal (sliding-window) mask of the chunk
    over keys at positions ``first ..``."""
    if m.dtype != torch.bool or m.dim() != 4 or tuple(m.shape[:3]) != (1, 1, T) or m.shape[3] < start + T - first:
        return False
    # a normal tensor's version counter sees an in-place change; an inference tensor (the Generator's
    # prompt, under inference mode) has none: such a mask is trusted not to change between the layers
    key = (m.data_ptr(), tuple(m.shape), m.stride(), None if m.is_inference() else m._version, start, T, window,
           first)
    last = _last_plain[0]
    if last is not None and last[0] is m and last[1] == key:
        return True
    end = start + T - first
    if bool(m[0, 0, :, end:].any()) or not torch.equal(m[0, 0, :, :end], _visible(start, T, end, window, first)):
        return False
    _last_plain[0] = (m, key)
    return True


def kt_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """q ``[1, H, T, D]``, k / v ``[1, Hkv, S, D]`` -> ``([1, T, H, D], None)``, as transformers' sdpa."""
    use = flash_eligible(module, query, key, value, attention_mask, dropout, is_causal, kwargs)
    if use is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    start, window, first = use
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return flash_attention(kernel_pool(), query, key, value, start, scale, window, bf16_pv=_mode() != "fp32",
                           key_first=first), None


def flash_mode() -> bool | None:
    """Whether the prompt flash kernel runs its P V on bf16 pairs (True), in fp32 (False), or does
    not run (None): ``KT_FLASH_ATTN`` on a tier that has the kernel.  The batching server's prompt
    chunks ask the same, so that every route reads a prompt with the same kernel."""
    mode = _mode()
    if mode == "0" or not flash_attention_supported():
        return None
    return mode != "fp32"


def _mode() -> str:
    """``KT_FLASH_ATTN``: ``1`` (default: bf16 probability x value), ``fp32``, ``0`` (transformers' sdpa)."""
    return os.environ.get("KT_FLASH_ATTN", "1")


_NAME_CHECK = re.compile(r"_attn_implementation\s*(==|!=|\bin\b|\bnot in\b)")
_branches: dict[str, bool] = {}


def _branches_on_name(cls) -> bool:
    """Whether the module defining ``cls`` compares the attention implementation's name."""
    mod = sys.modules.get(cls.__module__)
    key = getattr(mod, "__file__", None) or cls.__module__
    if key not in _branches:
        try:
            _branches[key] = bool(_NAME_CHECK.search(inspect.getsource(mod))) if mod is not None else True
        except (OSError, TypeError):
            _branches[key] = True
    return _branches[key]


# --------------------------------------------------------------------------- prompt RoPE
# transformers' attention modules rotate q and k with their modeling module's
# ``apply_rotary_pos_emb``: six torch passes over q (~7 ms a layer for a 512-token prompt of
# Qwen3-30B-A3B on 2 cores).  Where that function is the standard rotate-half one, it is answered
# by the one-pass kernel (kernels.attention.rope_prompt) for fp32 CPU prompts without autograd:
# the same bits (checked in tests/operators/test_prompt_rope.py), so every route and the
# unmodified model still agree; anything else goes to the original function.
_ROPE_LINES = ("q_embed = (q * cos) + (rotate_half(q) * sin)", "k_embed = (k * cos) + (rotate_half(k) * sin)")
_HALF_LINES = ("x1 = x[..., : x.shape[-1] // 2]", "x2 = x[..., x.shape[-1] // 2 :]", "torch.cat((-x2, x1), dim=-1)")


def _standard_rope(mod) -> bool:
    """Whether ``mod.apply_rotary_pos_emb`` is the standard rotate-half function (by its source)."""
    fn, half = getattr(mod, "apply_rotary_pos_emb", None), getattr(mod, "rotate_half", None)
    if not callable(fn) or not callable(half):
        return False
    try:
        src, hsrc = inspect.getsource(fn), inspect.getsource(half)
        params = list(inspect.signature(fn).parameters)
    except (OSError, TypeError, ValueError):
        return False
    return (params == ["q", "k", "cos", "sin", "unsqueeze_dim"] and all(line in src for line in _ROPE_LINES)
            and "unsqueeze(unsqueeze_dim)" in src and all(line in hsrc for line in _HALF_LINES))


def _fast_rope(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and q.shape[0] == 1 and k.shape[0] == 1
                and q.shape[2] == k.shape[2] and q.shape[3] == k.shape[3]
                and cos.shape == (1, q.shape[2], q.shape[3]) and sin.shape == cos.shape
                and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1
                        for t in (q, k, cos, sin))
                and cos.is_contiguous() and sin.is_contiguous() and q.shape[3] % 2 == 0
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin)))
                and os.environ.get("KT_PROMPT_ROPE", "1") != "0"):
            pool = kernel_pool()
            return rope_prompt(pool, q, cos, sin), rope_prompt(pool, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    apply_rotary_pos_emb._kt_prompt_rope = True
    return apply_rotary_pos_emb


def use_prompt_rope(model) -> int:
    """Answer the standard rotate-half ``apply_rotary_pos_emb`` of the modeling modules of
    ``model``'s transformers classes with the one-pass kernel (idempotent).  Returns how many
    modules were switched."""
    n = 0
    for name in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(name)
        if mod is None or not name.startswith("transformers.models."):
            continue
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if getattr(fn, "_kt_prompt_rope", False) or not _standard_rope(mod):
            continue
        mod.apply_rotary_pos_emb = _fast_rope(fn)
        n += 1
    return n


AttentionInterface.register(NAME, kt_sdpa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_cpu_attention(model) -> bool:
    """Switch a model's configs from ``sdpa`` to ``kt_sdpa`` (each config alone; other choices are
    kept), unless a module of the model comes from modeling code that branches on the name.
    Returns whether anything changed."""
    if any(_branches_on_name(type(m)) for m in model.modules() if type(m).__module__.startswith("transformers.")):
        return False
    changed = False
    seen: set[int] = set()
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        if getattr(cfg, "_attn_implementation", None) == "sdpa":
            cfg._attn_implementation_internal = NAME  # (the property's setter would recurse into sub-configs)
            changed = True
    return changed


__all__ = ["NAME", "flash_eligible", "flash_mode", "kt_sdpa_attention", "use_cpu_attention", "use_prompt_rope"]
