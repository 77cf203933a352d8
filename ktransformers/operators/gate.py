"""Routers.  ``KMoEGate`` reproduces the DeepSeek routers of transformers exactly (same
expert indices in the same order, same weights), vectorised and device-agnostic:

* DeepSeek-V3 / R1 / Kimi-K2 / Moonlight / GLM-4-MoE (router has ``e_score_correction_bias``):
  sigmoid scores, correction bias for the choice only, group-limited top-k (group score = sum
  of its top-2), weights from the unbiased scores, renormalisation, routed scaling.
* DeepSeek-V2 / V2-Lite (router has ``topk_method``): softmax scores, ``greedy`` or
  ``group_limited_greedy`` (group score = its max), routed scaling, no renormalisation.

Other routers keep their transformers forward and are only placed.  Returns
``(router_logits, top_k_weights, top_k_index)`` like the transformers routers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BaseInjectedModule
from .kinds import ROUTER
from .registry import register


def _group_keep(choice: torch.Tensor, n_group: int, topk_group: int, group_scores: torch.Tensor) -> torch.Tensor:
    T, E = choice.shape
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


def _row_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """``logits.sigmoid()`` with each row's bits independent of how many rows there are.  torch's
    elementwise loops run two vectors at a time and the rest through the scalar function, whose last
    bit may differ: a row of a width that is not a multiple of 32 would depend on its place among
    the others.  Such rows are widened to a multiple of 32 lanes (two vectors on every tier)."""
    E = logits.shape[-1]
    if logits.device.type != "cpu" or logits.dim() != 2 or E % 32 == 0:
        return logits.sigmoid()
    wide = logits.new_zeros(logits.shape[0], -(-E // 32) * 32)
    wide[:, :E] = logits
    return wide.sigmoid_()[:, :E]


def deepseek_v3_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                      norm_topk_prob: bool, routed_scaling_factor: float):
    """(weights [T,k], indices [T,k]) from fp32 router logits [T,E] (sigmoid + bias routing).

    Same torch ops in the same order as ``DeepseekV3TopkRouter`` (``topk(sorted=False)``), so
    indices come out in the same order even for tied scores."""
    scores = _row_sigmoid(logits)
    choice = scores + bias
    T, E = choice.shape
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    keep = _group_keep(choice, n_group, topk_group, group_scores)
    choice = choice.masked_fill(~keep, float("-inf"))
    idx = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, idx


def deepseek_v2_route(logits: torch.Tensor, top_k: int, topk_method: str, n_group: int, topk_group: int,
                      routed_scaling_factor: float, norm_topk_prob: bool = False):
    """(weights [T,k], indices [T,k]) from fp32 router logits [T,E] (softmax routing).

    ``topk_method``: ``greedy`` (plain top-k) or ``group_limited_greedy`` (keep the
    ``topk_group`` groups with the largest max score, zero the others, then top-k).
    ``norm_topk_prob`` is off in every DeepSeek-V2 checkpoint and ignored by transformers'
    router; it is applied only when a caller asks for it."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if topk_method == "greedy":
        weights, idx = scores.topk(top_k, dim=-1, sorted=False)
    elif topk_method == "group_limited_greedy":
        T, E = scores.shape
        group_scores = scores.view(T, n_group, E // n_group).max(dim=-1).values
        keep = _group_keep(scores, n_group, topk_group, group_scores)
        weights, idx = scores.masked_fill(~keep, 0.0).topk(top_k, dim=-1, sorted=False)
    else:
        raise ValueError(f"unknown topk_method '{topk_method}' (greedy, group_limited_greedy)")
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, idx


@register("KMoEGate")
class KMoEGate(BaseInjectedModule):
    """DeepSeek-V2/V3 / Kimi-K2 / Moonlight / GLM-4-MoE router (others are placed).  kwargs: devices."""

    REPLACES = (ROUTER,)

    def forward(self, hidden_states: torch.Tensor):
        orig = self.orig_module
        bias = self._buffers.get("e_score_correction_bias")
        topk_method = getattr(orig, "topk_method", None)
        if bias is None and topk_method is None:
            return type(orig).forward(self, hidden_states)
        w = self._parameters["weight"]
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).to(w.device)
        logits = F.linear(x.float(), w.float())
        if bias is not None:
            weights, idx = deepseek_v3_route(
                logits, bias.float(), orig.top_k, orig.num_group, orig.topk_group,
                orig.norm_topk_prob, orig.routed_scaling_factor,
            )
        else:
            weights, idx = deepseek_v2_route(
                logits, orig.top_k, topk_method, orig.num_group, orig.topk_group, orig.routed_scaling_factor,
            )
        return logits, weights, idx
