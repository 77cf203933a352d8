"""``KSFTExpertsCPU``: trainable routed experts on the CPU kernels (LoRA SFT).

Replaces a transformers 5 experts module like ``KTransformersExperts`` does (same ``backend``
rule kwarg: ``llamafile`` weights read in place in their GGUF type, ``AMXInt8`` / ``AMXBF16``
repacked; not the int4 backends), and runs it through a ``torch.autograd.Function`` whose backward is the C++ one
(``kernels.MoETrainKernel``): gradients flow to the hidden states, the routing weights (and so
to the router's torch ops) and the expert LoRA factors.  The base weights stay frozen and are
never expanded to float.

Expert LoRA lives on this module exactly as PEFT's ``ParamWrapper`` holds it for the fused
expert parameters of transformers 5 (``LoraConfig(target_parameters=[".._proj"])``):

* ``gate_up_proj`` [E, 2I, H]: ``lora_A.default.weight`` [r*E, H], ``lora_B.default.weight``
  [2I, r*E]; expert e's factors are ``A[e*r:(e+1)*r]`` and ``B[:, j*E + e]`` (j < r), delta
  ``scale * B_e @ A_e`` with gate rows first, as the fused parameter;
* ``down_proj`` [E, H, I]: ``lora_A`` [r*E, I], ``lora_B`` [H, r*E], the same way;
* with both targeted, PEFT nests the wrappers in parameter order: ``gate_up_proj``'s factors
  sit under ``base_layer.`` and ``down_proj``'s on the module itself.

``lora_state_dict()`` gives them under PEFT's adapter-file keys relative to this module (the
adapter name left out: ``base_layer.lora_A.weight`` ...); ``load_lora_state_dict`` takes those
or the in-memory names with ``.default``.

Saved activations per layer and step: the inputs (x [T, H], routing [T, k]) and the gate/up
pre-activations, T*k*2I float32 — or only the inputs with ``recompute: true`` (the backward
then runs the gate/up products again).  Under ``torch.utils.checkpoint`` nothing is kept
between forward and backward either way.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import RuleError
from .base import KwargSpec
from .cpu_experts import KExpertsCPU
from .experts import KTransformersExperts
from .registry import register

#: the fused expert parameters LoRA can target, in the order PEFT nests their wrappers
TARGETS = ("gate_up_proj", "down_proj")
#: KExpertsCPU backends the C++ backward (MoETrainKernel) reads the weights of; not the int4 ones
TRAIN_BACKENDS = ("llamafile", "AMXInt8", "AMXBF16")
ADAPTER = "default"


class _LoraFactors(nn.Module):
    """One projection's LoRA, as PEFT's ParamWrapper holds it (``lora_A/B.<adapter>``)."""

    def __init__(self, in_features: int, out_features: int, r: int, num_experts: int):
        super().__init__()
        self.lora_A = nn.ModuleDict({ADAPTER: nn.Linear(in_features, r * num_experts, bias=False)})
        self.lora_B = nn.ModuleDict({ADAPTER: nn.Linear(r * num_experts, out_features, bias=False)})
        nn.init.zeros_(self.lora_B[ADAPTER].weight)  # A keeps nn.Linear's kaiming init, as PEFT


def _parse_targets(targets) -> list[str]:
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


class _SFTExpertsFunction(torch.autograd.Function):
    """out = routed experts (x, ids, w) with LoRA; backward on the C++ kernels."""

    @staticmethod
    def forward(ctx, x, ids, w, kernel, scales, save, A_gu, B_gu, A_d, B_d):
        from ..kernels import LoraFactors

        gu = LoraFactors(A_gu, B_gu, scales[0]) if A_gu is not None else None
        dn = LoraFactors(A_d, B_d, scales[1]) if A_d is not None else None
        out, saved = kernel.forward(x, ids, w, gu, dn, save=save)
        ctx.kernel, ctx.scales = kernel, scales
        ctx.save_for_backward(x, ids, w, saved, A_gu, B_gu, A_d, B_d)
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        from ..kernels import LoraFactors

        x, ids, w, saved, A_gu, B_gu, A_d, B_d = ctx.saved_tensors
        gu = LoraFactors(A_gu, B_gu, ctx.scales[0]) if A_gu is not None else None
        dn = LoraFactors(A_d, B_d, ctx.scales[1]) if A_d is not None else None
        dx, dw, dA_gu, dB_gu, dA_d, dB_d = ctx.kernel.backward(x, ids, w, dout, saved, gu, dn)

        def cast(g, like):
            return None if g is None else g.to(like.dtype)

        return (dx.to(x.dtype), None, dw.to(w.dtype), None, None, None,
                cast(dA_gu, A_gu), cast(dB_gu, B_gu), cast(dA_d, A_d), cast(dB_d, B_d))


@register("KSFTExpertsCPU")
class KSFTExpertsCPU(KTransformersExperts):
    """Routed experts for LoRA fine-tuning on the CPU kernels (see the module docstring).

    kwargs: ``backend`` (one of ``TRAIN_BACKENDS``), ``recompute`` (bool),
    devices.  LoRA is added after loading with ``add_lora``.
    """

    OPS = {"KExpertsCPU": KExpertsCPU}
    DEFAULT_OP = "KExpertsCPU"
    KWARGS = {"recompute": KwargSpec((bool,), False, "the backward recomputes the gate/up pre-activations "
                                                     "instead of keeping them (T*k*2I floats per layer)")}

    def __init__(self, key, gguf_loader=None, config=None, orig_module=None, **kwargs):
        backend = kwargs.get("backend", "llamafile")
        if backend not in TRAIN_BACKENDS:
            raise RuleError(f"{key}: KSFTExpertsCPU has no backward for backend '{backend}'; "
                            f"use {', '.join(TRAIN_BACKENDS)}")
        recompute = bool(kwargs.pop("recompute", False))
        super().__init__(key, gguf_loader, config, orig_module, **kwargs)
        object.__setattr__(self, "recompute", recompute)
        object.__setattr__(self, "train_kernel", None)
        object.__setattr__(self, "lora_config", None)  # {"r", "alpha", "dropout", "targets", "use_rslora"}

    # -- weights ---------------------------------------------------------------------
    def load(self, weights, dtype):
        super().load(weights, dtype)
        from ..kernels import MoETrainKernel

        object.__setattr__(self, "train_kernel", MoETrainKernel(self.generate_op.kernel))

    def unload(self):
        object.__setattr__(self, "train_kernel", None)
        super().unload()

    # -- LoRA ------------------------------------------------------------------------
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
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"{self.key}: expert LoRA rank must be a positive int, got {r!r}")
        if dropout:
            raise ValueError(f"{self.key}: expert LoRA takes lora_dropout 0 only (PEFT's ParamWrapper for fused "
                             f"expert parameters cannot apply dropout either), got {dropout}")
        if self.lora_config is not None:
            raise ValueError(f"{self.key}: expert LoRA is already added")
        if self.train_kernel is None:
            raise ValueError(f"{self.key}: add_lora after the model's weights are loaded")
        targets = _parse_targets(targets)
        E, H, I = self.generate_op.num_experts, self.generate_op.hidden, self.generate_op.intermediate
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

    def _kernel_factors(self):
        """(A_gu, B_gu, A_d, B_d) in the kernel layout, as differentiable views of the parameters."""
        op = self.generate_op
        E = op.num_experts
        out = {"gate_up_proj": (None, None), "down_proj": (None, None)}
        for t, (A, B) in self.lora_parameters().items():
            r = self.lora_config["r"]
            out[t] = (A.view(E, r, A.shape[1]), B.view(B.shape[0], r, E).permute(2, 0, 1))
        return (*out["gate_up_proj"], *out["down_proj"])

    # -- compute ---------------------------------------------------------------------
    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.train_kernel is None:
            raise RuntimeError(f"{self.key}: KSFTExpertsCPU weights are not loaded")
        dev = hidden_states.device
        cpu = torch.device("cpu")
        s = self.lora_scale() if self.lora_config else 0.0
        save = torch.is_grad_enabled() and not self.recompute
        out = _SFTExpertsFunction.apply(hidden_states.to(cpu), top_k_index.to(cpu), top_k_weights.to(cpu),
                                        self.train_kernel, (s, s), save, *self._kernel_factors())
        return out.to(self.out_device or dev)

    def submit(self, hidden_states, top_k_index, top_k_weights):
        return self.forward(hidden_states, top_k_index, top_k_weights)  # training: synchronous

    def collect(self, token):
        return token
