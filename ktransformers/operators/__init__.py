"""Injected operators.  ``all_operators()`` is the registry of short names usable in rules."""

from __future__ import annotations

import importlib

from .base import BaseInjectedModule, Op

# modules whose import registers more ops (CPU kernels, FP8, attention); optional ones may
# be absent in a build and are skipped
_OPTIONAL_OP_MODULES = ("cpu_experts", "cpu_linear", "fp8_linear", "gpu_quant_linear", "attention")


def all_operators() -> dict[str, type]:
    from .embedding import KTransformersEmbedding
    from .experts import KTransformersExperts
    from .gate import KMoEGate
    from .layernorm import KRMSNorm
    from .linear import KTransformersLinear
    from .mlp import KMLP
    from .models import KTransformersModel
    from .moe import KMoEBlock
    from .RoPE import KRotaryEmbedding

    for name in _OPTIONAL_OP_MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:  # only a missing module of ours is optional
            if e.name != f"{__name__}.{name}":
                raise
    ops: dict[str, type] = {
        "KTransformersLinear": KTransformersLinear,
        "KTransformersEmbedding": KTransformersEmbedding,
        "KTransformersExperts": KTransformersExperts,
        "KTransformersExpertsV2": KTransformersExperts,
        "KMoEBlock": KMoEBlock,
        "KMoEGate": KMoEGate,
        "KRotaryEmbedding": KRotaryEmbedding,
        "KRMSNorm": KRMSNorm,
        "KMLP": KMLP,
        "KTransformersModel": KTransformersModel,
    }
    from . import experts as _experts

    for alias in _experts._MOE_BLOCK_NAMES:
        ops[alias] = KMoEBlock
    try:
        from .attention import ATTENTION_OPERATORS

        ops.update(ATTENTION_OPERATORS)
    except ImportError:
        pass
    return ops


__all__ = ["BaseInjectedModule", "Op", "all_operators"]
