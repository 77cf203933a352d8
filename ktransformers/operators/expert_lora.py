"""LoRA on the routed experts' fused parameters, held as PEFT holds it, for any experts operator.

PEFT's ``ParamWrapper`` (``LoraConfig(target_parameters=[".._proj"])``) adapts the fused expert
parameters of transformers 5:

* ``gate_up_proj`` [E, 2I, H]: ``lora_A.default.weight`` [r*E, H], ``lora_B.default.weight``
  [2I, r*E]; expert e's factors are ``A[e*r:(e+1)*r]`` and ``B[:, j*E + e]`` (j < r), delta
  ``scale * B_e @ A_e`` with gate rows first, as the fused parameter;
* ``down_proj`` [E, H, I]: ``lora_A`` [r*E, I], ``lora_B`` [H, r*E], the same way;
* with both targeted, PEFT nests the wrappers in parameter order: ``gate_up_proj``'s factors
  sit under ``base_layer.`` and ``down_proj``'s on the module itself.

:class:`ExpertLora` gives an experts operator that layout (``add_lora``, ``lora_state_dict``,
``load_lora_state_dict``) and the factors in the kernels' per-expert layout
(``kernel_lora``: A [E, r, in], B [E, out, r]), which the training operator differentiates and
the inference ops apply beside their base computation (``ExpertsOp.lora_forward``).  Kept apart
from the operators so both the inference and the training operator hold LoRA the same way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

#: the fused expert parameters LoRA can target, in the order PEFT nests their wrappers
TARGETS = ("gate_up_proj", "down_proj")
ADAPTER = "default"


class KernelLora(NamedTuple):
    """Expert LoRA in the kernels' layout: A [E, r, in], B [E, out, r] per projection (None: not
    targeted) and the one scale ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""

    A_gu: torch.Tensor | None
    B_gu: torch.Tensor | None
    A_d: torch.Tensor | None
    B_d: torch.Tensor | None
    scale: float


class _LoraFactors(nn.Module):
    """One projection's LoRA, as PEFT's ParamWrapper holds it (``lora_A/B.<adapter>``)."""

    def __init__(self, in_features: int, out_features: int, r: int, num_experts: int):
        super().__init__()
        self.lora_A = nn.ModuleDict({ADAPTER: nn.Linear(in_features, r * num_experts, bias=False)})
        self.lora_B = nn.ModuleDict({ADAPTER: nn.Linear(r * num_experts, out_features, bias=False)})
        nn.init.zeros_(self.lora_B[ADAPTER].weight)  # A keeps nn.Linear's kaiming init, as PEFT


def parse_targets(targets) -> list[str]:
    """The fused parameters ``targets`` names (PEFT's ``target_parameters`` entries or leaves), in
    PEFT's order; ValueError naming a target that is not one."""
    if isinstance(targets, str):
        targets = [targets]
    out = []
    for t in targets:
        leaf = str(t).rpartition(".")[2]
        if leaf in ("gate_proj", "up_proj"):
            raise ValueError(f"expert LoRA target '{t}': transformers 5 fuses gate and up into one parameter; "
                             f"target 'gate_up_proj'")
        if leaf not in TARGETS:
            raise ValueError(f"expert LoRA target '{t}' is not an expert parameter ({', '.join(TARGETS)})")
        if leaf not in out:
            out.append(leaf)
    if not out:
        raise ValueError(f"expert LoRA: no target given ({', '.join(TARGETS)})")
    return [t for t in TARGETS if t in out]


class ExpertLora:
    """Mixin of experts operators: LoRA factors in PEFT's layout (see the module docstring).

    The operator sets ``lora_config = None`` in its constructor and provides
    ``lora_geometry() -> (experts, hidden, intermediate)`` and ``check_lora_ready()`` (ValueError
    when its weights cannot carry LoRA yet, or at all)."""

    lora_config: dict | None

    def lora_geometry(self) -> tuple[int, int, int]:  # pragma: no cover - interface
        raise NotImplementedError

    def check_lora_ready(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _holders(self) -> dict[str, nn.Module]:
        """target -> the module holding its ``lora_A``/``lora_B`` (PEFT's nesting)."""
        cfg = self.lora_config
        if cfg is None:
            return {}
        out, mod = {}, self
        for t in reversed(cfg["targets"]):  # the last target is the outermost wrapper
            out[t] = mod
            mod = mod._modules.get("base_layer")
        return out

    def _prefixes(self) -> dict[str, str]:
        cfg = self.lora_config
        n = len(cfg["targets"]) if cfg else 0
        return {t: "base_layer." * (n - 1 - i) for i, t in enumerate(cfg["targets"])} if cfg else {}

    def add_lora(self, r: int, alpha: float, dropout: float = 0.0, targets=TARGETS, use_rslora: bool = False):
        """Create expert LoRA factors (B zero, A kaiming-uniform, like PEFT) on ``targets``."""
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise ValueError(f"{self.key}: expert LoRA rank must be a positive int, got {r!r}")
        if dropout:
            raise ValueError(f"{self.key}: expert LoRA takes lora_dropout 0 only (PEFT's ParamWrapper for fused "
                             f"expert parameters cannot apply dropout either), got {dropout}")
        if self.lora_config is not None:
            raise ValueError(f"{self.key}: expert LoRA is already added")
        self.check_lora_ready()
        targets = parse_targets(targets)
        E, H, I = self.lora_geometry()
        dims = {"gate_up_proj": (H, 2 * I), "down_proj": (I, H)}
        holder = self
        for i, t in enumerate(reversed(targets)):
            if i > 0:
                nxt = nn.Module()
                holder._modules["base_layer"] = nxt
                holder = nxt
            f = _LoraFactors(*dims[t], r, E)
            holder._modules["lora_A"] = f.lora_A
            holder._modules["lora_B"] = f.lora_B
        object.__setattr__(self, "lora_config", {"r": r, "alpha": alpha, "dropout": 0.0, "targets": targets,
                                                 "use_rslora": bool(use_rslora)})

    def lora_scale(self) -> float:
        cfg = self.lora_config
        return cfg["alpha"] / (math.sqrt(cfg["r"]) if cfg["use_rslora"] else cfg["r"])

    def lora_parameters(self) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """target -> (A weight, B weight) as PEFT shapes them."""
        return {t: (h.lora_A[ADAPTER].weight, h.lora_B[ADAPTER].weight) for t, h in self._holders().items()}

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """Expert LoRA under PEFT's adapter-file keys relative to this module (no adapter name)."""
        pre = self._prefixes()
        out = {}
        for t, (A, B) in self.lora_parameters().items():
            out[f"{pre[t]}lora_A.weight"] = A.detach()
            out[f"{pre[t]}lora_B.weight"] = B.detach()
        return out

    def load_lora_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """The reverse of ``lora_state_dict`` (keys with or without ``.default``); every key must fit."""
        if self.lora_config is None:
            raise ValueError(f"{self.key}: add_lora before loading expert LoRA weights")
        own = {}
        pre = self._prefixes()
        for t, (A, B) in self.lora_parameters().items():
            own[f"{pre[t]}lora_A.weight"] = A
            own[f"{pre[t]}lora_B.weight"] = B
        seen = set()
        for key, v in sd.items():
            k = key.replace(f".{ADAPTER}.", ".")
            if k not in own:
                raise ValueError(f"{self.key}: unexpected expert LoRA key '{key}' (expected {', '.join(sorted(own))})")
            p = own[k]
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"{self.key}: expert LoRA '{key}' has shape {list(v.shape)}, expected {list(p.shape)}")
            with torch.no_grad():
                p.copy_(v)
            seen.add(k)
        missing = sorted(set(own) - seen)
        if missing:
            raise ValueError(f"{self.key}: expert LoRA state dict lacks {', '.join(missing)}")

    def kernel_lora(self) -> KernelLora:
        """The factors in the kernels' layout, as differentiable views of the parameters (None where
        a projection has no LoRA; no LoRA at all: every factor None, scale 0)."""
        out = {"gate_up_proj": (None, None), "down_proj": (None, None)}
        if self.lora_config is None:
            return KernelLora(None, None, None, None, 0.0)
        E, r = self.lora_geometry()[0], self.lora_config["r"]
        for t, (A, B) in self.lora_parameters().items():
            out[t] = (A.view(E, r, A.shape[1]), B.view(B.shape[0], r, E).permute(2, 0, 1))
        return KernelLora(*out["gate_up_proj"], *out["down_proj"], self.lora_scale())
