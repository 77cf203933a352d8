"""Dense gated MLPs on the CPU kernels in one call: ``down(act(gate(x)) * up(x))``.

transformers' MLP runs gate and up as two linears (each quantising the input), the activation and
the product as two torch passes over ``[T, intermediate]`` (Gemma-3-270M, 16k-token prompt: ~3 s
of ~25 in GELU and the product).  Where both linears are served by ``KLinearCPU`` on one pool, the
module's forward is the standard one (by its source) and the activation is SiLU or GELU-tanh, the
gate and up rows go through one ``LinearGroupKernel`` with the activation fused -- the call the
lean decode step makes for one token, so a prompt's row and a decoded row take the same path.
Anything else runs the module's own forward: training, autograd, another dtype or device, an
adapter wrapped around a projection, a projection served by another op at that token count,
``KT_FUSED_MLP=0``.
"""

from __future__ import annotations

import inspect
import os
import types

import torch

from .cpu_linear import KLinearCPU

#: what the standard gated MLP's forward returns (Llama, Mistral, Qwen2/3, Gemma-3, shared experts)
_FORWARD_LINE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
_ACTS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
         "GELUPytorchTanh": "gelu_tanh"}


def _op(linear, tokens: int):
    """The ``KLinearCPU`` that serves ``linear`` for ``tokens`` rows with its output on the CPU, or None."""
    select = getattr(linear, "select_op", None)
    if select is None or getattr(linear, "out_device", None) not in (None, "cpu"):
        return None
    pre = linear.prefill_op
    op = pre if pre is not None and tokens > linear.prefill_threshold else linear.generate_op
    if not isinstance(op, KLinearCPU) or getattr(op, "kernel", None) is None or op.bias is not None:
        return None
    return op


def _standard(mlp) -> str | None:
    """The fused activation's name when ``mlp`` is a standard gated MLP, else None."""
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return None
    act = _ACTS.get(type(mlp.act_fn).__name__)
    if act is None:
        return None
    try:
        src = inspect.getsource(type(mlp).forward)
    except (OSError, TypeError):
        return None
    return act if _FORWARD_LINE in src else None


def _fused_forward(self, x):
    gate, up = self._kt_gate_up
    T = x.numel() // x.shape[-1] if x.dim() else 0
    ops = (_op(gate, T), _op(up, T)) if T else (None, None)
    if (self.training or x.dtype != torch.float32 or x.device.type != "cpu" or T == 0
            or self.gate_proj is not gate or self.up_proj is not up
            or ops[0] is not self._kt_ops[0] or ops[1] is not self._kt_ops[1]
            or (torch.is_grad_enabled() and x.requires_grad)
            or os.environ.get("KT_FUSED_MLP", "1") == "0"):
        return self._kt_original_forward(x)
    group = self._kt_group()
    h = torch.empty(*x.shape[:-1], group.out_features, dtype=torch.float32)
    group.forward(x.reshape(T, x.shape[-1]).contiguous(), h.view(T, group.out_features))
    return self.down_proj(h)


def use_fused_mlp(model) -> int:
    """Give every standard gated MLP of ``model`` whose gate and up run on ``KLinearCPU`` the fused
    forward (idempotent); returns how many were switched.  The kernel group is built on first use
    (the weights are loaded by then)."""
    from ..kernels import LinearGroupKernel

    switched = 0
    for mod in model.modules():
        if hasattr(mod, "_kt_gate_up"):
            continue
        act = _standard(mod)
        if act is None:
            continue
        ops = (_op(mod.gate_proj, 2), _op(mod.up_proj, 2))
        if ops[0] is None or ops[1] is None or ops[0].pool is not ops[1].pool:
            continue
        if ops[0].out_features != ops[1].out_features or ops[0].in_features != ops[1].in_features:
            continue
        cache = {}

        def group(ops=ops, act=act, cache=cache):
            g = cache.get("g")
            if g is None or any(m is not op.kernel for m, op in zip(g.members, ops)):
                g = cache["g"] = LinearGroupKernel([ops[0].kernel, ops[1].kernel], glu=act)
            return g

        mod._kt_gate_up = (mod.gate_proj, mod.up_proj)
        mod._kt_ops = ops
        mod._kt_group = group
        mod._kt_original_forward = mod.forward
        mod.forward = types.MethodType(_fused_forward, mod)
        switched += 1
    return switched


__all__ = ["use_fused_mlp"]
