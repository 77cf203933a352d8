"""The MoE block: route, run routed experts, add shared experts — overlapping where it can.

One operator serves every sparse block of transformers 5 (Qwen2/3-MoE, Mixtral, DeepSeek
V2/V3, GLM-4-MoE, DeepSeek-V4): it reads the block's children (``gate``/``router``, ``experts``,
``shared_expert(s)``, ``shared_expert_gate``).  When the experts run asynchronously
(``KExpertsCPU``), the routed experts are submitted first and the shared experts computed
while they run.  A router whose forward takes ``input_ids`` (DeepSeek-V4's hash router: the
experts are a fixed function of the token id) gets the ids the decoder layer passes the block.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F

from .base import BaseInjectedModule
from .kinds import MOE_BLOCK
from .registry import register

_TORCH_LINEAR = F.linear  # torch's own, captured once (KMoEBlock._row_invariant_linears swaps it in and out)


@register("KMoEBlock")
class KMoEBlock(BaseInjectedModule):
    """Sparse MoE block with routed/shared overlap.  kwargs: devices only."""

    REPLACES = (MOE_BLOCK,)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        router = self._modules.get("gate") or self._modules.get("router")
        with self._row_invariant_linears():
            if _takes_input_ids(type(router)):
                if input_ids is None:
                    raise ValueError(f"{self.key}: {type(router).__name__} routes by token id and got no input_ids "
                                     f"(call the model with input_ids, not inputs_embeds)")
                # the ids come from where the embeddings are (the CPU in the GPU rules), the router's table is here
                _, top_k_weights, top_k_index = router(x, input_ids.to(x.device))
            elif _routes_in_cpp(router, x):
                from ..kernels.moe import route_softmax_topk

                logits = F.linear(x, router.weight)
                top_k_weights, top_k_index = route_softmax_topk(logits, int(router.num_experts), int(router.top_k),
                                                                bool(router.norm_topk_prob))
            else:
                _, top_k_weights, top_k_index = router(x)
        experts = self.experts
        if hasattr(experts, "submit"):
            token = experts.submit(x, top_k_index, top_k_weights)
            shared = self._shared(x)
            routed = experts.collect(token)
        else:
            shared = self._shared(x)
            routed = experts(x, top_k_index, top_k_weights)
        if shared is not None:
            routed = routed + shared.to(routed.device)
        return routed.reshape(shape)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        mods = self._modules
        if "shared_experts" in mods:
            return mods["shared_experts"](x)
        if "shared_expert" in mods:
            out = mods["shared_expert"](x)
            gate = mods.get("shared_expert_gate")
            if gate is not None:
                with self._row_invariant_linears():
                    out = _row_sigmoid(gate(x)) * out
            return out
        return None

    @contextlib.contextmanager
    def _row_invariant_linears(self):
        """Within: ``F.linear`` on the router's and the shared-expert gate's fp32 CPU weights runs on
        the CPU linear kernel, whose rows do not depend on how many rows a call has (torch's BLAS
        takes another path for one row than for many, so a token's routing would change with the
        batch beside it).  Other calls go to torch as before."""
        kernels = self.__dict__.get("_kt_row_kernels")
        if kernels is None:
            kernels = self.__dict__["_kt_row_kernels"] = _row_kernels(self)
        if not kernels:
            yield
            return

        def linear(inp, weight, bias=None):
            k = kernels.get(id(weight))
            if (k is None or k[0] is not weight or inp.device.type != "cpu" or inp.dtype != torch.float32
                    or torch.is_grad_enabled() and (inp.requires_grad or weight.requires_grad)):
                return _TORCH_LINEAR(inp, weight, bias)
            out = k[1].forward(inp.reshape(-1, inp.shape[-1]).contiguous()).reshape(*inp.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias

        # (another thread meanwhile gets the same math: its own weights go to torch's linear)
        F.linear = linear
        try:
            yield
        finally:
            F.linear = _TORCH_LINEAR


#: routers whose forward is linear -> softmax -> top-k -> renormalise when ``norm_topk_prob`` (transformers')
SOFTMAX_TOPK_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter")


def _routes_in_cpp(router, x: torch.Tensor) -> bool:
    """Whether the block routes ``x`` itself, by the router's own math in one fixed order per row
    (``kernels.route_softmax_topk``, the decode step's routing too), instead of calling the router:
    a softmax-top-k router with an fp32 weight, x fp32 on the CPU, no autograd.  torch's softmax
    and top-k give a row other bits than the decode step's one-row routing."""
    w = getattr(router, "weight", None)
    return (type(router).__name__ in SOFTMAX_TOPK_ROUTERS and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.dtype == torch.float32 and w.device.type == "cpu" and x.dtype == torch.float32
            and x.device.type == "cpu" and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and hasattr(router, "top_k") and hasattr(router, "norm_topk_prob")
            and int(getattr(router, "num_experts", w.shape[0])) == w.shape[0])


def _row_sigmoid(g: torch.Tensor) -> torch.Tensor:
    """sigmoid of a ``[T, 1]`` gate, each row's bits independent of T.  torch's elementwise loops run
    two vectors at a time and the rest through the scalar function, whose last bit may differ: over
    T values a token's gate would depend on its place among the others.  Each row widened to 32
    lanes (a multiple of two vectors on every tier) is computed by the vector path alone."""
    if g.device.type != "cpu" or g.dim() < 1 or g.shape[-1] != 1:
        return F.sigmoid(g)
    return F.sigmoid(g.expand(*g.shape[:-1], 32).contiguous())[..., :1]


def _row_kernels(block) -> dict:
    """id(weight) -> (weight, LinearKernel) for the block's router and shared-expert gate weights
    that are fp32 matrices on the CPU (empty when the CPU kernels are not built)."""
    from ..kernels import LinearKernel
    from .cpu_threads import kernel_pool

    out = {}
    for name in ("gate", "router", "shared_expert_gate"):
        mod = block._modules.get(name)
        w = getattr(mod, "weight", None)
        if (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
                and not w.is_meta):
            try:
                out[id(w)] = (w, LinearKernel(kernel_pool(), "llamafile", w.shape[1], w.shape[0], w.detach().contiguous(), "F32"))
            except (ImportError, RuntimeError, ValueError):
                return {}
    return out


@functools.lru_cache(maxsize=None)
def _takes_input_ids(router_cls: type) -> bool:
    """Whether the router class's forward takes ``input_ids`` (asked once per class, not per token)."""
    fn = getattr(router_cls, "forward", None)
    try:
        return "input_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
