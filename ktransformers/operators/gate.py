"""Routers.  ``KMoEGate`` is DeepSeek-V3-style routing (sigmoid scores, correction bias for
the choice only, group-limited top-k, renormalisation, routed scaling), vectorised and
device-agnostic; other routers keep their transformers forward and only get placed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BaseInjectedModule


def deepseek_v3_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                      norm_topk_prob: bool, routed_scaling_factor: float):
    """(weights [T,k], indices [T,k]) from fp32 router logits [T,E]."""
    scores = logits.sigmoid()
    choice = scores + bias
    T, E = choice.shape
    if n_group > 1 and topk_group < n_group:
        group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        choice = choice.masked_fill(~keep, float("-inf"))
    idx = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, idx


class KMoEGate(BaseInjectedModule):
    """DeepSeek-V3 / Kimi-K2 / GLM-4-MoE router.  kwargs: devices.

    Returns ``(router_logits, top_k_weights, top_k_index)`` like the transformers router, so
    the block and ``output_router_logits`` keep working.
    """

    def forward(self, hidden_states: torch.Tensor):
        if not hasattr(self, "e_score_correction_bias") or self.e_score_correction_bias is None:
            return type(self.orig_module).forward(self, hidden_states)
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).to(self.weight.device)
        logits = F.linear(x.float(), self.weight.float())
        weights, idx = deepseek_v3_route(
            logits, self.e_score_correction_bias.float(), self.top_k, self.num_group, self.topk_group,
            self.norm_topk_prob, self.routed_scaling_factor,
        )
        return logits, weights, idx
