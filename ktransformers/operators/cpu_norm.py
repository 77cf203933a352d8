"""RMSNorm on the CPU in one pass (``decode_ops.rms_norm``, the lean decode step's C++ norm).

transformers' RMSNorm is five torch ops (pow, mean, add, rsqrt, two muls) over the whole input;
over a prompt's per-head q / k norms (``[T, heads, head_dim]``, a mean over 128 elements per row)
torch took 7-30 ms a layer at 512 tokens where one C++ pass takes well under one.  A transposed
view is normed in its storage order (no copy): each row is computed the same way whatever the
count or the layout, so its bits are the same.  (On the kernels' pool the q norm of a 512-token
Qwen3-30B-A3B prompt took 3.3 ms a layer against 0.8 on the calling thread: the pool is busy
beside it; a prompt's norms stay on the calling thread.)  Each norm module
of an injected model is probed once with a small random input and switched only if it computes
``w * x / rms(x)`` or Gemma's ``(1 + w) * x / rms(x)`` (in fp32, within 1e-5) -- whatever its class
-- so that a family with another formula keeps its own forward.  The fast path takes
fp32 CPU inputs of a module in eval mode under no gradient; anything else (training: a
checkpointed forward runs without gradients, its recomputation with them, and both must agree),
and ``KT_FAST_NORM=0``, runs the original.
"""

from __future__ import annotations

import os
import types

import torch

from .. import cpuinfer_ext

_rms_norm = cpuinfer_ext.decode_ops.rms_norm


def _formula(module) -> str | None:
    """``"w"``, ``"1+w"`` or None: which RMSNorm ``module`` computes, found by running it once."""
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.is_meta or w.device.type != "cpu" or not isinstance(eps, float):
        return None
    n = w.numel()
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            got = module(x).float()
    except Exception:  # noqa: BLE001 - a module that cannot run on a plain input keeps its forward
        return None
    base = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    for name, ww in (("w", w.float()), ("1+w", 1.0 + w.float())):
        want = base * ww
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            return name
    return None


def _fast_forward(self, hidden_states):
    x = hidden_states
    if (self.training or x.device.type != "cpu" or self.weight.device.type != "cpu" or x.dtype != torch.float32
            or x.numel() == 0 or x.shape[-1] != self.weight.numel()
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
            or os.environ.get("KT_FAST_NORM", "1") == "0"):
        return self._kt_original_forward(hidden_states)
    w = self.weight.detach().float()
    if self._kt_norm_formula == "1+w":
        w = 1.0 + w
    w = w.contiguous()
    n = w.numel()
    # rows of any layout (Gemma's q / k norms see [1, heads, T, d] after the transpose): the same C++
    # pass for a prompt's rows and one token's, so a row's bits do not depend on how many there are.
    # A dense permutation with contiguous rows is normed in its storage order, into the same layout.
    if not _dense_rows(x):
        x = x.contiguous()
    out = torch.empty_like(x)
    if out.stride() != x.stride():
        x = x.contiguous()
        out = torch.empty_like(x)
    _rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // n, n, 0, self._kt_norm_eps)
    return out


def _dense_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is its storage read in some dimension order, rows of the last dimension
    contiguous (``[1, T, H, d]`` seen as ``[1, H, T, d]``): then the storage is normed row by row."""
    if x.stride(-1) != 1:
        return False
    order = sorted(range(x.dim() - 1), key=lambda i: -x.stride(i)) + [x.dim() - 1]
    return x.permute(order).is_contiguous()


def use_fast_norms(model) -> int:
    """Give every RMSNorm module of ``model`` that passes the probe the one-pass forward; returns
    how many were switched."""
    switched = 0
    for mod in model.modules():
        if "RMSNorm" not in type(mod).__name__ or hasattr(mod, "_kt_norm_formula"):
            continue
        formula = _formula(mod)
        if formula is None:
            continue
        mod._kt_norm_formula = formula
        mod._kt_norm_eps = float(getattr(mod, "variance_epsilon", getattr(mod, "eps", 0.0)))
        mod._kt_original_forward = mod.forward
        mod.forward = types.MethodType(_fast_forward, mod)
        switched += 1
    return switched


__all__ = ["use_fast_norms"]
