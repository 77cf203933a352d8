"""``KSFTExpertsCPU``: trainable routed experts on the CPU kernels (LoRA SFT).

Replaces a transformers 5 experts module like ``KTransformersExperts`` does (same ``backend``
rule kwarg: ``llamafile`` weights read in place in their GGUF type, ``AMXInt8`` / ``AMXBF16``
repacked; not the int4 backends), and runs it through a ``torch.autograd.Function`` whose backward is the C++ one
(``kernels.MoETrainKernel``): gradients flow to the hidden states, the routing weights (and so
to the router's torch ops) and the expert LoRA factors.  The base weights stay frozen and are
never expanded to float.

Expert LoRA lives on this module in PEFT's ``ParamWrapper`` layout (``expert_lora.py``, shared
with the inference operator); ``lora_state_dict()`` gives it under PEFT's adapter-file keys
relative to this module, ``load_lora_state_dict`` takes those or the in-memory names.

Saved activations per layer and step: the inputs (x [T, H], routing [T, k]) and the gate/up
pre-activations, T*k*2I float32 — or only the inputs with ``recompute: true`` (the backward
then runs the gate/up products again).  Under ``torch.utils.checkpoint`` nothing is kept
between forward and backward either way.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..errors import RuleError
from .base import KwargSpec
from ..kernels.moe import IN_PLACE_BACKEND, LORA_BACKENDS
from .cpu_experts import KExpertsCPU
from .experts import KTransformersExperts
from .registry import register

#: KExpertsCPU backends the C++ backward (MoETrainKernel) reads the weights of; not the int4 ones
TRAIN_BACKENDS = LORA_BACKENDS


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
    TRAINS_LORA = True
    KWARGS = {"recompute": KwargSpec((bool,), False, "the backward recomputes the gate/up pre-activations "
                                                     "instead of keeping them (T*k*2I floats per layer)")}

    def __init__(self, key, gguf_loader=None, config=None, orig_module=None, **kwargs):
        backend = kwargs.get("backend", IN_PLACE_BACKEND)
        if backend not in TRAIN_BACKENDS:
            raise RuleError(f"{key}: KSFTExpertsCPU has no backward for backend '{backend}'; "
                            f"use {', '.join(TRAIN_BACKENDS)}")
        recompute = bool(kwargs.pop("recompute", False))
        super().__init__(key, gguf_loader, config, orig_module, **kwargs)
        object.__setattr__(self, "recompute", recompute)
        object.__setattr__(self, "train_kernel", None)

    # -- weights ---------------------------------------------------------------------
    def load(self, weights, dtype):
        super().load(weights, dtype)
        from ..kernels import MoETrainKernel

        object.__setattr__(self, "train_kernel", MoETrainKernel(self.generate_op.kernel))

    def unload(self):
        object.__setattr__(self, "train_kernel", None)
        super().unload()

    # -- LoRA (held by ExpertLora) ----------------------------------------------------
    def check_lora_ready(self) -> None:
        if self.train_kernel is None:
            raise ValueError(f"{self.key}: add_lora after the model's weights are loaded")

    # -- compute ---------------------------------------------------------------------
    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.train_kernel is None:
            raise RuntimeError(f"{self.key}: KSFTExpertsCPU weights are not loaded")
        dev = hidden_states.device
        cpu = torch.device("cpu")
        lora = self.kernel_lora()
        save = torch.is_grad_enabled() and not self.recompute
        out = _SFTExpertsFunction.apply(hidden_states.to(cpu), top_k_index.to(cpu), top_k_weights.to(cpu),
                                        self.train_kernel, (lora.scale, lora.scale), save, *lora[:4])
        return out.to(self.out_device or dev)

    def submit(self, hidden_states, top_k_index, top_k_weights):
        return self.forward(hidden_states, top_k_index, top_k_weights)  # training: synchronous

    def collect(self, token):
        return token
