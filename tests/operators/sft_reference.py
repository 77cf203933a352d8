"""Pure-torch oracle of the routed experts with LoRA in PEFT's fused-parameter layout
(dequantized weights, torch autograd), for the KSFTExpertsCPU gradient tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def peft_factors(A: torch.Tensor, B: torch.Tensor, num_experts: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's (A_e [r, in], B_e [out, r]) from ParamWrapper's lora_A [r*E, in] / lora_B [out, r*E]."""
    r = A.shape[0] // num_experts
    return A.view(num_experts, r, -1)[e], B.view(B.shape[0], r, num_experts)[:, :, e]


def silu_glu(g, u):
    return F.silu(g) * u


def experts_reference(x, ids, w, gate_up, down, lora: dict | None = None, scale: float = 1.0, glu=silu_glu):
    """sum_j w[t,j] * expert_{ids[t,j]}(x[t]) with gate_up [E, 2I, H], down [E, H, I] (float),
    optional ``lora = {"gate_up_proj": (A, B), "down_proj": (A, B)}`` in PEFT's layout, and
    ``glu(gate, up) -> h`` the gated activation."""
    E, two_i, _ = gate_up.shape
    lora = lora or {}
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32)
    for e in range(E):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xs = x[tok].float()
        gu = xs @ gate_up[e].T
        if "gate_up_proj" in lora:
            A, B = peft_factors(*lora["gate_up_proj"], E, e)
            gu = gu + scale * (xs @ A.T) @ B.T
        g, u = gu.chunk(2, dim=-1)
        h = glu(g, u)
        y = h @ down[e].T
        if "down_proj" in lora:
            A, B = peft_factors(*lora["down_proj"], E, e)
            y = y + scale * (h @ A.T) @ B.T
        out = out.index_add(0, tok, y * w[tok, slot, None].float())
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| relative to max |ref|."""
    return (got.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-30)
