"""Which ggml type each GGUF tensor is written as.

Type policy, like llama-quantize's (:class:`TypePolicy`): routed experts ``--experts``; attention
projections ``--attention``; ``token_embd`` ``--embeddings``; ``output`` ``--output-type``; everything
else 2-D ``--default`` (MXFP4 through gguf-py's quantizer); 1-D tensors (norms, biases), the router
``ffn_gate_inp`` and ``exp_probs_b`` stay ``--norms`` (F32).  Rows that are not a multiple of a
type's block fall back to the type its row in :mod:`..weights.ggml_types` names (llama-quantize's
choice), else F16 (:func:`fit_type`).

``--preset Q4_K_M`` (or Q2_K, Q3_K_S/M/L, Q4_K_S, Q5_K_S/M, Q6_K, Q8_0, Q4_0, IQ4_NL, IQ4_XS, ...)
replaces the per-role types with llama-quantize's own per-tensor mix for that preset
(:class:`PresetPolicy`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..weights import gguf_names as gn
from ..weights.ggml_types import ggml_type_info
from ..weights.quantize import QUANTIZABLE


#: 2-D tensors llama.cpp never quantizes: routers, the correction bias, the DeltaNet's short conv
_FLOAT_LEAVES = ("ffn_gate_inp", "ffn_gate_inp_shexp", "exp_probs_b", "ssm_conv1d")


@dataclass
class TypePolicy:
    experts: str = "Q4_K"
    attention: str = "Q8_0"
    default: str = "Q6_K"
    embeddings: str | None = None
    output: str | None = None
    norms: str = "F32"

    def __post_init__(self):
        for k in ("experts", "attention", "default", "embeddings", "output", "norms"):
            v = getattr(self, k)
            if v is None:
                continue
            v = v.upper()
            if v not in QUANTIZABLE:
                raise ConfigError(f"--{k}: cannot write ggml type {v!r} (choose from {', '.join(QUANTIZABLE)})")
            setattr(self, k, v)

    def choose(self, gguf_name: str, shape: tuple[int, ...]) -> str:
        leaf = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
        if len(shape) == 1 or leaf in _FLOAT_LEAVES:
            t = self.norms
        elif leaf.endswith("_exps"):
            t = self.experts
        elif leaf.startswith("attn_"):
            t = self.attention
        elif leaf == "token_embd":
            t = self.embeddings or self.default
        elif leaf == "output":
            t = self.output or self.default
        else:
            t = self.default
        return fit_type(t, shape[-1])


#: llama-quantize's presets we can write: preset -> base type of the mix
PRESETS = {"Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_0": "Q4_0", "Q4_1": "Q4_1",
           "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K",
           "Q6_K": "Q6_K", "Q8_0": "Q8_0", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "F16": "F16", "BF16": "BF16",
           "F32": "F32"}
#: presets of llama-quantize whose types (the other IQ*) we have no quantizer for
UNWRITABLE_PRESETS = ("IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS",
                      "IQ2_XXS", "IQ1_M", "IQ1_S", "Q2_K_S", "TQ1_0", "TQ2_0", "MXFP4_MOE")


def _more_bits(i: int, n: int) -> bool:
    """llama-quantize's choice of layers that get a bigger type: the first and last eighth, and
    every third layer in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class PresetPolicy:
    """The per-tensor type mix llama-quantize chooses for a preset (no importance matrix).

    Facts it follows: the output matrix (and tied embeddings) get Q6_K unless the preset is Q8_0;
    ``attn_v`` gets more bits in Q2_K / Q3_K_* / Q4_K_* / Q5_K_M (layer-dependent), Q8_0 with 8
    experts, ``attn_k`` too; ``ffn_down*`` (experts and shared experts included) more bits in
    Q2_K / Q3_K_* / Q4_K_* / Q5_K_M by layer; ``attn_output`` Q5_K with 8 experts for the
    lower presets; IQ4_NL / IQ4_XS: ``attn_v`` Q5_K where 4+ query heads share a KV head,
    ``ffn_down`` of the first eighth of the layers Q5_K; rows that do not fit a type's block
    fall back as :func:`fit_type` says.
    """

    preset: str
    n_layer: int
    n_expert: int = 0
    n_gqa: int = 1
    n_attn_v: int = 0
    tied: bool = False

    def __post_init__(self):
        p = self.preset.upper()
        if p in UNWRITABLE_PRESETS:
            raise ConfigError(f"--preset {self.preset}: its types have no quantizer here "
                              f"(writable presets: {', '.join(PRESETS)})")
        if p not in PRESETS:
            raise ConfigError(f"--preset {self.preset}: unknown preset (choose from {', '.join(PRESETS)})")
        self.preset = p

    @property
    def base(self) -> str:
        return PRESETS[self.preset]

    def choose(self, gguf_name: str, shape: tuple[int, ...]) -> str:
        leaf = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
        if len(shape) == 1 or leaf in _FLOAT_LEAVES:
            return "F32"
        t = self.base
        if not ggml_type_info(t).quantized:
            return t
        m = re.match(r"^blk\.(\d+)\.", gguf_name)
        layer = int(m.group(1)) if m else 0
        p, n, eight = self.preset, self.n_layer, self.n_expert == 8
        if leaf == "output" or (leaf == "token_embd" and self.tied):
            if shape[-1] % ggml_type_info(t).block_elems:
                return "Q8_0"
            return "Q8_0" if t == "Q8_0" else "Q6_K"
        if leaf in ("attn_v", "attn_qkv", "attn_kv_b"):
            i = layer
            if p == "Q2_K":
                t = "Q4_K" if self.n_gqa >= 4 else "Q3_K"
            elif p == "Q3_K_M":
                t = "Q5_K" if i < 2 else "Q4_K"
            elif p == "Q3_K_L":
                t = "Q5_K"
            elif p in ("Q4_K_M", "Q5_K_M") and _more_bits(i, self.n_attn_v):
                t = "Q6_K"
            elif p in ("IQ4_NL", "IQ4_XS") and self.n_gqa >= 4:
                t = "Q5_K"
            elif p == "Q4_K_S" and i < 4:
                t = "Q5_K"
            if eight:
                t = "Q8_0"
            if leaf == "attn_qkv":
                t = {"Q3_K_M": "Q4_K", "Q3_K_L": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(p, t)
        elif leaf == "attn_k" and eight:
            t = "Q8_0"
        elif leaf.startswith("ffn_down"):
            i = layer
            if p == "Q2_K":
                t = "Q3_K"
            elif p == "Q3_K_M":
                t = "Q5_K" if i < n // 16 else "Q4_K"
            elif p == "Q3_K_L":
                t = "Q5_K"
            elif p in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n):
                t = "Q6_K"
            elif p in ("IQ4_NL", "IQ4_XS") and i < n // 8:
                t = "Q5_K"
            elif p == "Q4_K_S" and i < n // 8:
                t = "Q5_K"
        elif leaf == "attn_output":
            if eight and p in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS"):
                t = "Q5_K"
            elif not eight:
                t = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(p, t)
        return fit_type(t, shape[-1])

    @classmethod
    def for_config(cls, preset: str, config, arch: str) -> "PresetPolicy":
        c = config
        n_expert = int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
                       or getattr(c, "n_routed_experts", None) or 0)
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        # one attn_v per layer, except split-MLA deepseek2 (attn_k_b / attn_v_b count as other tensors)
        n_attn_v = 0 if arch in gn.MLA_ARCHS else c.num_hidden_layers
        return cls(preset, n_layer=c.num_hidden_layers, n_expert=n_expert, n_gqa=heads // max(1, kv),
                   n_attn_v=n_attn_v, tied=bool(getattr(c, "tie_word_embeddings", False)))


def fit_type(t: str, row: int) -> str:
    """The type actually written for rows of ``row`` values: the type itself where its block fits
    the row, else its row's fallback (llama-quantize's) where that fits, else F16."""
    info = ggml_type_info(t)
    if row % info.block_elems == 0:
        return info.name
    if info.fallback is not None and row % ggml_type_info(info.fallback).block_elems == 0:
        return info.fallback
    if info.block_elems > 1:
        return "F16"
    return info.name
