"""The MoE block: route, run routed experts, add shared experts — overlapping where it can.

One operator serves every sparse block of transformers 5 (Qwen2/3-MoE, Mixtral, DeepSeek
V2/V3, GLM-4-MoE, DeepSeek-V4): it reads the block's children (``gate``/``router``, ``experts``,
``shared_expert(s)``, ``shared_expert_gate``).  When the experts run asynchronously
(``KExpertsCPU``), the routed experts are submitted first and the shared experts computed
while they run.  A router whose forward takes ``input_ids`` (DeepSeek-V4's hash router: the
experts are a fixed function of the token id) gets the ids the decoder layer passes the block.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from .base import BaseInjectedModule
from .kinds import MOE_BLOCK
from .registry import register


@register("KMoEBlock")
class KMoEBlock(BaseInjectedModule):
    """Sparse MoE block with routed/shared overlap.  kwargs: devices only."""

    REPLACES = (MOE_BLOCK,)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        router = self._modules.get("gate") or self._modules.get("router")
        if _takes_input_ids(type(router)):
            if input_ids is None:
                raise ValueError(f"{self.key}: {type(router).__name__} routes by token id and got no input_ids "
                                 f"(call the model with input_ids, not inputs_embeds)")
            # the ids come from where the embeddings are (the CPU in the GPU rules), the router's table is here
            _, top_k_weights, top_k_index = router(x, input_ids.to(x.device))
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
                out = F.sigmoid(gate(x)) * out
            return out
        return None


@functools.lru_cache(maxsize=None)
def _takes_input_ids(router_cls: type) -> bool:
    """Whether the router class's forward takes ``input_ids`` (asked once per class, not per token)."""
    fn = getattr(router_cls, "forward", None)
    try:
        return "input_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
