"""``KSFTExpertsTorch``: routed experts for training in plain torch autograd, LoRA in PEFT's layout.

The base weights are the experts' own ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]
parameters, dequantized by the loader and frozen.  It is the computation the CPU training
operator (``KSFTExpertsCPU``) performs with its kernels, with the same LoRA interface
(``add_lora`` / ``lora_state_dict`` / ``load_lora_state_dict``), so a rule file picks either:
this one for small models, GPUs and as the reference; the kernels for models whose experts only
fit in DRAM in their quantized form.

LoRA layout (PEFT ``ParamWrapper`` on a 3-D expert parameter that is stored as
``[experts, out, in]``): ``lora_A`` is ``[r * E, in]`` (expert ``e`` owns rows ``e*r:(e+1)*r``),
``lora_B`` is ``[out, r * E]`` (expert ``e`` owns columns ``e, e+E, e+2E, ...``, i.e.
``B.view(out, r, E)[:, :, e]``); the update of expert ``e`` is ``scaling * B_e @ A_e``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..operators.base import BaseInjectedModule
from ..operators.experts import routed_groups
from ..operators.kinds import EXPERTS
from ..operators.registry import register

#: the experts' fused parameters LoRA can target, in the module's parameter order
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def peft_key_prefixes(targets) -> dict[str, str]:
    """Key prefix (relative to the experts module) of each targeted parameter's LoRA in PEFT's files.

    PEFT nests one ``ParamWrapper`` per targeted parameter, wrapping in the module's parameter
    order, so the first targeted parameter sits innermost (``base_layer.`` once per wrapper
    outside it)."""
    ordered = [p for p in EXPERT_PARAMS if p in targets]
    n = len(ordered)
    return {p: "base_layer." * (n - 1 - i) for i, p in enumerate(ordered)}


@register("KSFTExpertsTorch")
class KSFTExpertsTorch(BaseInjectedModule):
    """Routed experts with optional LoRA on ``gate_up_proj`` / ``down_proj``, torch autograd.

    Use ``recursive: false`` in the rule."""

    REPLACES = (EXPERTS,)
    TRAINS_LORA = True

    def __init__(self, key, gguf_loader=None, config=None, orig_module=None, **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, **kwargs)
        if getattr(orig_module, "is_transposed", False):
            raise ConfigError(f"{key}: experts stored transposed ([E, H, 2I]) are not supported for training")
        object.__setattr__(self, "lora_targets", ())
        object.__setattr__(self, "lora_scaling", 0.0)
        object.__setattr__(self, "lora_rank", 0)

    @property
    def num_experts(self) -> int:
        return int(self.gate_up_proj.shape[0])

    # -- LoRA -------------------------------------------------------------------------
    def add_lora(self, r: int, alpha: float, dropout: float = 0.0, targets=EXPERT_PARAMS,
                 use_rslora: bool = False) -> None:
        """Create LoRA A/B for each of ``targets`` (A Kaiming-uniform, B zero, as PEFT)."""
        bad = [t for t in targets if t not in EXPERT_PARAMS]
        targets = tuple(t for t in EXPERT_PARAMS if t in targets)
        if bad or not targets:
            raise ConfigError(f"{self.key}: expert LoRA targets must be among {', '.join(EXPERT_PARAMS)}")
        if dropout:
            raise ConfigError("lora_dropout: PEFT's LoRA on expert parameters takes no dropout; set 0")
        E = self.num_experts
        for t in targets:
            w = getattr(self, t)
            _, out_f, in_f = w.shape
            a = torch.empty(r * E, in_f, dtype=torch.float32, device=w.device)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            b = torch.zeros(out_f, r * E, dtype=torch.float32, device=w.device)
            self.register_parameter(f"lora_A_{t}", nn.Parameter(a))
            self.register_parameter(f"lora_B_{t}", nn.Parameter(b))
        object.__setattr__(self, "lora_targets", targets)
        object.__setattr__(self, "lora_scaling", float(alpha) / (math.sqrt(r) if use_rslora else r))
        object.__setattr__(self, "lora_rank", int(r))

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors under PEFT's key names relative to this module."""
        pre = peft_key_prefixes(self.lora_targets)
        out = {}
        for t in self.lora_targets:
            out[f"{pre[t]}lora_A.weight"] = getattr(self, f"lora_A_{t}").detach()
            out[f"{pre[t]}lora_B.weight"] = getattr(self, f"lora_B_{t}").detach()
        return out

    def load_lora_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        pre = peft_key_prefixes(self.lora_targets)
        want = {f"{pre[t]}lora_{ab}.weight": (t, ab) for t in self.lora_targets for ab in "AB"}
        if set(sd) != set(want):
            raise ConfigError(f"{self.key}: adapter holds expert LoRA {sorted(sd)}, expected {sorted(want)}")
        with torch.no_grad():
            for k, (t, ab) in want.items():
                p = getattr(self, f"lora_{ab}_{t}")
                if tuple(sd[k].shape) != tuple(p.shape):
                    raise ConfigError(f"{self.key}: adapter tensor '{k}' has shape {list(sd[k].shape)}, "
                                      f"expected {list(p.shape)} (rank or expert count differs)")
                p.copy_(sd[k])

    def _lora(self, t: str, e: int, x: torch.Tensor) -> torch.Tensor | None:
        if t not in self.lora_targets:
            return None
        r, E = self.lora_rank, self.num_experts
        a = getattr(self, f"lora_A_{t}")[e * r:(e + 1) * r]  # [r, in]
        b = getattr(self, f"lora_B_{t}")[:, e::E]  # [out, r]
        return F.linear(F.linear(x.to(a.dtype), a), b) * self.lora_scaling

    # -- forward ----------------------------------------------------------------------
    def forward(self, hidden_states, top_k_index, top_k_weights):
        T = top_k_index.shape[0]
        out = torch.zeros(T, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
        for e, sel, w in routed_groups(top_k_index, top_k_weights, self.num_experts):
            xs = hidden_states.index_select(0, sel)
            gu = F.linear(xs.to(self.gate_up_proj.dtype), self.gate_up_proj[e])
            d = self._lora("gate_up_proj", e, xs)
            if d is not None:
                gu = gu + d.to(gu.dtype)
            gate, up = gu.chunk(2, dim=-1)
            h = self.act_fn(gate) * up
            y = F.linear(h, self.down_proj[e])
            d = self._lora("down_proj", e, h)
            if d is not None:
                y = y + d.to(y.dtype)
            y = y * w[:, None].to(y.dtype)
            out = out.index_add(0, sel, y.to(out.dtype))
        return out
