"""Module kinds: what sort of module of a transformers model an operator can replace.

Each operator declares the kinds it replaces (``BaseInjectedModule.REPLACES``); the plan
refuses a rule that puts it on a module of another kind, before anything is built, and
did-you-mean suggestions only name operators of the same kind.  A kind is read from the
module itself (its class, its children, its tensors), so it holds for every model family.
"""

from __future__ import annotations

import torch
from torch import nn

LINEAR = "linear"
EXPERTS = "experts container (stacked 3-D gate_up_proj / down_proj)"
MOE_BLOCK = "MoE block (router + experts)"
ROUTER = "router"
ATTENTION = "attention"
MLA_ATTENTION = "multi-head latent attention"
NORM = "norm"
ROTARY = "rotary embedding"
MLP = "dense MLP"
BACKBONE = "decoder backbone"
EMBEDDING = "token embedding"

ALL_KINDS = (LINEAR, EXPERTS, MOE_BLOCK, ROUTER, ATTENTION, MLA_ATTENTION, NORM, ROTARY, MLP, BACKBONE, EMBEDDING)


def kinds_of(module: nn.Module) -> frozenset[str]:
    """The kinds ``module`` is (usually one; MLA attention is also attention)."""
    name = type(module).__name__
    children = dict(module.named_children())
    out = set()
    if isinstance(module, nn.Linear):
        out.add(LINEAR)
    if isinstance(module, nn.Embedding):
        out.add(EMBEDDING)
    gate_up = getattr(module, "gate_up_proj", None)
    if isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and isinstance(getattr(module, "down_proj", None),
                                                                             torch.Tensor):
        out.add(EXPERTS)
    if "experts" in children and ("gate" in children or "router" in children):
        out.add(MOE_BLOCK)
    if not isinstance(module, nn.Linear) and ("Router" in name or name.endswith("Gate")):
        out.add(ROUTER)
    if name.endswith("Attention"):
        out.add(ATTENTION)
        if getattr(module, "kv_lora_rank", None):
            out.add(MLA_ATTENTION)
    if "Norm" in name:
        out.add(NORM)
    if "Rotary" in name:
        out.add(ROTARY)
    if name.endswith("MLP") and not out & {MOE_BLOCK, EXPERTS}:
        out.add(MLP)
    if isinstance(children.get("layers"), nn.ModuleList) and name.endswith("Model"):
        out.add(BACKBONE)
    return frozenset(out)


def kind_from_name(text: str) -> str | None:
    """The kind an operator name suggests (``KMoEGateFoo`` -> router), for suggestions only."""
    t = text.lower()
    for needle, kind in (("gate", ROUTER), ("router", ROUTER), ("atten", ATTENTION), ("attn", ATTENTION),
                         ("experts", EXPERTS), ("moe", MOE_BLOCK), ("sparse", MOE_BLOCK), ("linear", LINEAR),
                         ("norm", NORM), ("rotary", ROTARY), ("rope", ROTARY), ("mlp", MLP), ("embed", EMBEDDING),
                         ("model", BACKBONE)):
        if needle in t:
            return kind
    return None


def describe(kinds) -> str:
    return " or ".join(sorted(kinds)) if kinds else "no known kind"
