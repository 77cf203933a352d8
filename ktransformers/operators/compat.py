"""The reference system's names, and what they are here: the one compatibility table.

Rule files written for the reference system (kvcache-ai/ktransformers) name its operators,
ops, expert backends, module paths and kwargs.  Every such name resolves through this table
to the part of this project that does the same job, and ``explain`` prints one line per
alias a rule file used (``KLinearMarlin → KLinearGPUQ (GPU quantized linear)``).  Names with
no counterpart here are listed in :data:`NOT_PROVIDED` with what to use instead.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..kernels.moe import AMX_LAYOUT_BACKENDS


@dataclass(frozen=True)
class Alias:
    """One reference-system name: ``ours`` is the name here, ``what`` says what it does."""

    ours: str
    what: str


_MOE = Alias("KMoEBlock", "MoE block: router, routed experts overlapped with shared experts")
_EXPERTS = Alias("KTransformersExperts", "routed experts with per-phase ops")
_GATE = Alias("KMoEGate", "DeepSeek-style router")
_ROPE = Alias("KRotaryEmbedding", "rotary embedding, placed")
_NORM = Alias("KRMSNorm", "RMSNorm, placed")
_MLP = Alias("KMLP", "dense MLP, placed")
_MODEL = Alias("KTransformersModel", "decoder backbone; device hops follow the layers' rules")
_MLA = Alias("KDeepseekV2Attention", "absorbed multi-head latent attention")
_ATTN = Alias("default", "the transformers attention, placed; the batching server pages its cache")

#: operator class names (the leaf of ``ktransformers.operators.<module>.<Name>``)
OPERATORS: dict[str, Alias] = {
    **dict.fromkeys(("KDeepseekV2MoE", "KDeepseekV3MoE", "KDeepseekV3MoEV2", "KQwen2MoeSparseMoeBlock",
                     "KQwen2MoeSparseMoeBlockV2", "KQwen3MoeSparseMoeBlock", "KQwen3MoeSparseMoeBlockV2",
                     "KMistralSparseMoEBlock", "KGlm4MoeMoE"), _MOE),
    **dict.fromkeys(("KTransformersExpertsV2", "KGlm4Experts"), _EXPERTS),
    **dict.fromkeys(("KMoEGateDeepSeekV3", "KMoEGateQwen2Moe"), _GATE),
    **dict.fromkeys(("RotaryEmbedding", "RotaryEmbeddingV2", "RotaryEmbeddingV3", "RotaryEmbeddingV4",
                     "YarnRotaryEmbedding", "YarnRotaryEmbeddingV3", "DynamicNTKScalingRotaryEmbedding",
                     "DeepSeekV3YarnRotaryEmbedding", "KQwen3MoeRotaryEmbedding", "KGlm4MoeRotaryEmbedding"), _ROPE),
    **dict.fromkeys(("RMSNorm", "KQwen2MoeRMSNorm", "KQwen3MoeRMSNorm", "KGlm4MoeRMSNorm",
                     "DeepseekV3RMSNormTorch"), _NORM),
    **dict.fromkeys(("kDeepseekV3MLP", "KDeepseekV3MLP", "KQwen2MoeMLP", "KGlm4MoeMLP"), _MLP),
    **dict.fromkeys(("KDeepseekV2Model", "KQwen2MoeModel", "KLlamaModel", "KQwen3MoeModel"), _MODEL),
    "KDeepseekV3Attention": _MLA,
    **dict.fromkeys(("KQwen2MoeAttention", "KQwen3MoeAttention", "KGlm4MoeAttention", "flashinfer_attn"), _ATTN),
}

#: the GPU linear that keeps quantized weights; the closest existing op stands in where it is absent
_GPU_QUANT_LINEAR = "KLinearGPUQ"
_GPU_QUANT_FALLBACK = "KLinearTorch"

#: ops, per op table (``generate_op`` / ``prefill_op`` values)
OPS: dict[str, dict[str, Alias]] = {
    "linear": {
        "KLinearMarlin": Alias(_GPU_QUANT_LINEAR, "GPU quantized linear"),
        "VLinearMarlin": Alias(_GPU_QUANT_LINEAR, "GPU quantized linear"),
        "KLinearQ8": Alias(_GPU_QUANT_LINEAR, "quantized linear"),
        "KLinearCPUInfer": Alias("KLinearCPU", "quantized linear on the CPU kernels"),
    },
    "experts": {
        "KExpertsMarlin": Alias("KExpertsTorch", "experts dequantized on the op's device"),
        # its fine-tuning rules name the trainable op here; an adapter's expert LoRA applies beside the
        # inference kernels, and training takes the operator (replace.class) of that name
        "KSFTExpertsCPU": Alias("KExpertsCPU", "routed experts on the CPU kernels, an adapter's expert LoRA "
                                               "beside them; to fine-tune, name class: KSFTExpertsCPU"),
    },
}

#: ``backend`` values that name the AMX tile layout (the packing backends): on a CPU without AMX the
#: same layout runs on the best ISA tier it has (docs/rules.md, backend table); the rule records one
#: line saying so
AMX_BACKENDS = AMX_LAYOUT_BACKENDS

#: kwarg spellings of the reference system -> ours
KWARGS: dict[str, str] = {
    "per_layer_prefill_intput_threshold": "prefill_threshold",
    "chunck_size": "chunk_size",
}

#: the value the reference system writes for "no op" (YAML reads ``None`` as this string)
NULL_OP = "None"

#: reference model module paths (``match.class: ktransformers.models.modeling_deepseek_v3.MoEGate``)
#: -> the transformers module holding the same classes
MODULE_PATHS: dict[str, str] = {
    "ktransformers.models.modeling_deepseek": "transformers.models.deepseek_v2.modeling_deepseek_v2",
    "ktransformers.models.modeling_deepseek_v2": "transformers.models.deepseek_v2.modeling_deepseek_v2",
    "ktransformers.models.modeling_deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "ktransformers.models.modeling_llama": "transformers.models.llama.modeling_llama",
    "ktransformers.models.modeling_mixtral": "transformers.models.mixtral.modeling_mixtral",
    "ktransformers.models.modeling_qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "ktransformers.models.modeling_qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "ktransformers.models.modeling_glm4_moe": "transformers.models.glm4_moe.modeling_glm4_moe",
}

_V3 = "transformers.models.deepseek_v3.modeling_deepseek_v3."

#: class names the reference modeling files spell differently; a tuple value matches any of them
#: (its Qwen3-MoE rules name Qwen2-MoE's rotary class for Qwen3-MoE models, and its DeepSeek-V3
#: rules name classes of ``modeling_deepseek``, V2's file, for V3 models)
CLASS_NAMES: dict[tuple[str, str], tuple[str, ...]] = {
    ("ktransformers.models.modeling_deepseek", "MoEGate"): ("DeepseekV2TopkRouter", _V3 + "DeepseekV3TopkRouter"),
    ("ktransformers.models.modeling_deepseek", "DeepseekV2MoE"): ("DeepseekV2Moe", _V3 + "DeepseekV3MoE"),
    ("ktransformers.models.modeling_deepseek", "DeepseekV2YarnRotaryEmbedding"): ("DeepseekV2RotaryEmbedding",),
    ("ktransformers.models.modeling_deepseek", "DeepseekV3YarnRotaryEmbedding"): (_V3 + "DeepseekV3RotaryEmbedding",),
    ("ktransformers.models.modeling_deepseek_v2", "MoEGate"): ("DeepseekV2TopkRouter",),
    ("ktransformers.models.modeling_deepseek_v2", "DeepseekV2MoE"): ("DeepseekV2Moe",),
    ("ktransformers.models.modeling_deepseek_v2", "DeepseekV2YarnRotaryEmbedding"): ("DeepseekV2RotaryEmbedding",),
    ("ktransformers.models.modeling_deepseek_v3", "MoEGate"): ("DeepseekV3TopkRouter",),
    ("ktransformers.models.modeling_deepseek_v3", "DeepseekV3YarnRotaryEmbedding"): ("DeepseekV3RotaryEmbedding",),
    ("ktransformers.models.modeling_qwen2_moe", "Qwen2MoeRotaryEmbedding"): (
        "Qwen2MoeRotaryEmbedding", "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding"),
    ("ktransformers.models.modeling_glm4_moe", "MoEGate"): ("Glm4MoeTopkRouter",),
}

#: reference names with no counterpart here, and what to use instead
NOT_PROVIDED: dict[str, str] = {
    "KLinearIPEXLLM": "KLinearTorch",
    "KQwen3MoeAttentionIPEXLLM": "default (keep the transformers attention)",
    "KMoEGateIPEXLLM": "KMoEGate or default",
    "KLlamaAttention": "default (keep the transformers attention)",
}


def op_alias(table: str, name: str, known: dict[str, Any]) -> Alias | None:
    """The alias of a reference op name in ``table`` (``known``: this family's registered ops).

    The GPU quantized linear stands in for the Marlin ops where it is registered; otherwise
    the closest existing op (a dequantized linear) does."""
    alias = OPS.get(table, {}).get(name)
    if alias is not None and alias.ours == _GPU_QUANT_LINEAR and _GPU_QUANT_LINEAR not in known:
        return Alias(_GPU_QUANT_FALLBACK, "dequantized linear; this build has no GPU quantized linear")
    return alias


def normalize_kwargs(kwargs: dict) -> tuple[dict, list[tuple[str, str, str]]]:
    """Rule kwargs with reference spellings replaced by ours; also the (theirs, ours, what) used."""
    out, used = {}, []
    for key, value in kwargs.items():
        ours = KWARGS.get(key)
        if ours is not None:
            used.append((key, ours, "kwarg spelling"))
            key = ours
        if key == "prefill_op" and value == NULL_OP:
            used.append((f"prefill_op: {NULL_OP}", "prefill_op: null", "the generate op serves every call"))
            value = None
        if key == "backend" and value in AMX_BACKENDS:
            tier = _isa_tier()
            if tier is not None and tier != "amx":
                used.append((f"backend: {value}", f"{value} on the {tier} tier", "this CPU has no AMX; the same "
                             "packed layout runs on its best kernels"))
        out[key] = value
    return out, used


def _isa_tier() -> str | None:
    """The CPU kernels' ISA tier in force, None where the kernels are not built or KT_ISA is invalid
    (that error is the kernels' to give, at load)."""
    try:
        from ..kernels.pool import isa_tier

        return isa_tier()
    except (ImportError, ValueError):
        return None


def resolve_class_path(text: str) -> tuple[Any, ...] | None:
    """Classes behind a reference model class path, or None when ``text`` is not one."""
    mod, _, leaf = text.rpartition(".")
    target = MODULE_PATHS.get(mod)
    if target is None:
        return None
    out = []
    for name in CLASS_NAMES.get((mod, leaf), (leaf,)):
        path = name if "." in name else f"{target}.{name}"
        m, _, attr = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(m), attr, None)
        except (ImportError, TypeError, ValueError):
            cls = None
        if cls is None:
            return ()
        out.append(cls)
    return tuple(out)
