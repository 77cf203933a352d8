"""Hugging Face <-> GGUF (llama.cpp) tensor names, for the architectures we load and write.

Names are mapped in both directions by one table per architecture.  GGUF names are llama.cpp's
(``blk.N.attn_q.weight``); HF names are transformers 5.24's (``model.layers.N.self_attn.q_proj.weight``).
Routed experts use the stacked *virtual* HF names of :mod:`.source`
(``model.layers.N.mlp.experts.{gate,up,down}_proj``, torch ``[E, I, H]`` / ``[E, H, I]``).

What a mapping alone cannot express is described by :class:`Transform` flags that the GGUF source
(reading) and the converter (writing) apply:

* ``llama`` arch: ``attn_q`` / ``attn_k`` rows are permuted by llama.cpp's converter (rotary pairs
  interleaved per head); :func:`unpermute_qk` undoes it, :func:`permute_qk` does it.
* ``qwen35moe``: llama.cpp stores the DeltaNet's V heads tiled across key heads where HF groups them
  per key head (:func:`v_head_orders`); the other value transforms are qwen3next's.
* ``gemma3``: llama.cpp stores every RMSNorm weight as ``w + 1`` (Gemma computes ``x * (1 + w)``);
  HF ``w`` = GGUF value - 1 (transformers' own GGUF loader does the same).
* ``deepseek2`` split MLA: ``attn_k_b [H, nope, kv_lora]`` + ``attn_v_b [H, v, kv_lora]`` (torch
  order) rebuild HF ``kv_b_proj.weight [H*(nope+v), kv_lora]``: per head ``cat(k_b[h].T, v_b[h])``.
* Tied output: no ``output.weight`` -> ``lm_head.weight`` is ``token_embd.weight``.
* ``deepseek4``: no value transform; the hash router's ``ffn_gate_tid2eid`` table is stored I32
  (HF int64), llama.cpp drops the hash layers' unused correction bias, and its converter writes
  the routed experts MXFP4 (what the release ships).
* MTP (next-n) block: llama.cpp keeps the MTP layer of GLM-4-MoE, GLM-5 (``glm-dsa``) and DeepSeek
  (``deepseek2``, ``deepseek32``; its converter drops DeepSeek-V3's) as the last block
  (``block_count`` counts it, ``nextn_predict_layers`` says how many): its decoder layer under the
  usual ``blk.N.*`` names, its own tensors as ``blk.N.nextn.*`` (``_NEXTN``), served as the
  checkpoint's ``model.layers.N.*`` (N = the model's ``num_hidden_layers``).
* ``gpt-oss``: the experts' biases are stored per projection (``ffn_{gate,up,down}_exps.bias``) and
  served as ``model.layers.N.mlp.experts.{gate,up,down}_proj_bias`` (``[E, I]`` / ``[E, H]``, the
  stacked layout; the model's ``gate_up_proj_bias`` interleaves gate and up: ``ExpertsLayout``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: architectures the source and the converter handle (GGUF ``general.architecture`` values)
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "deepseek2", "deepseek32", "glm-dsa", "gemma3",
                   "glm4moe", "minimax-m2", "gpt-oss", "qwen3next", "qwen35moe", "deepseek4", "qwen3vlmoe")
#: DeepSeek MLA architectures (split ``attn_k_b`` / ``attn_v_b``, the ``deepseek2`` metadata keys)
MLA_ARCHS = ("deepseek2", "deepseek32", "glm-dsa")
#: MLA with the sparse-attention indexer (``indexer.*`` tensors, ``attention.indexer.*`` keys)
DSA_ARCHS = ("deepseek32", "glm-dsa")
#: gated DeltaNet linear attention (``ssm_*`` tensors and keys, ``ssm_a = -exp(A_log)``) beside
#: gated full attention (``attn_q`` holds each head's query and its output gate)
LINEAR_ATTN_ARCHS = ("qwen3next", "qwen35moe")

#: transformers ``model_type`` -> GGUF arch
MODEL_TYPE_TO_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "deepseek_v32": "deepseek32",
    "glm_moe_dsa": "glm-dsa",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "glm4_moe": "glm4moe",
    "minimax_m2": "minimax-m2",
    "qwen3_next": "qwen3next",
    "qwen3_5_moe_text": "qwen35moe",
    "deepseek_v4": "deepseek4",
}  # gpt_oss: read only (its experts' layout is not the converter's yet)

#: transformers ``model_type`` -> why the converter does not write it (llama.cpp has the architecture)
NOT_WRITTEN: dict[str, str] = {}

# (gguf leaf without .weight/.bias, hf leaf without .weight/.bias)
_ATTENTION = [
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
]
_DENSE_MLP = [("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]

_COMMON_BLOCK = _ATTENTION + _DENSE_MLP + [("ffn_norm", "post_attention_layernorm"), ("ffn_gate_inp", "mlp.gate")]

_GEMMA3_BLOCK = _ATTENTION + _DENSE_MLP + [
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
]

_MLA_BLOCK = [
    ("attn_q_a", "self_attn.q_a_proj"),
    ("attn_q_a_norm", "self_attn.q_a_layernorm"),
    ("attn_q_b", "self_attn.q_b_proj"),
    ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
    ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
    ("attn_kv_b", "self_attn.kv_b_proj"),
]


# the sparse-attention indexer of DeepSeek-V3.2 / GLM-5 (llama.cpp's ``indexer.*`` tensors; GLM-5's
# layers reusing the previous top-k have none)
_INDEXER = [
    ("indexer.attn_q_b", "self_attn.indexer.wq_b"),
    ("indexer.attn_k", "self_attn.indexer.wk"),
    ("indexer.k_norm", "self_attn.indexer.k_norm"),
    ("indexer.proj", "self_attn.indexer.weights_proj"),
]


# the MTP block's own tensors (llama.cpp's ``MODEL_TENSOR.NEXTN_*``, gguf-py constants.py);
# ``embed_tokens`` / ``shared_head.head`` repeat the model's embedding and output head
_NEXTN = [
    ("nextn.eh_proj", "eh_proj"),
    ("nextn.enorm", "enorm"),
    ("nextn.hnorm", "hnorm"),
    ("nextn.shared_head_norm", "shared_head.norm"),
    ("nextn.embed_tokens", "embed_tokens"),
    ("nextn.shared_head_head", "shared_head.head"),
]


def _shexp(hf_prefix: str):
    return [
        ("ffn_gate_shexp", f"{hf_prefix}.gate_proj"),
        ("ffn_up_shexp", f"{hf_prefix}.up_proj"),
        ("ffn_down_shexp", f"{hf_prefix}.down_proj"),
    ]


# GLM-4-MoE: llama.cpp names the norm before the MLP ``post_attention_norm`` (not ``ffn_norm``)
_GLM4MOE_BLOCK = [(g, h) for g, h in _COMMON_BLOCK if g != "ffn_norm"] + [
    ("post_attention_norm", "post_attention_layernorm")] + _shexp("mlp.shared_experts")

#: where ``exp_probs_b.bias`` (the router's correction bias) lives; MiniMax-M2 keeps it on the block
_EXP_PROBS_B = {"minimax-m2": "mlp.e_score_correction_bias"}

# gpt-oss: the router is ``mlp.router`` (weight and bias), the norm before the MLP ``post_attention_norm``
_GPT_OSS_BLOCK = _ATTENTION + [("post_attention_norm", "post_attention_layernorm"), ("ffn_gate_inp", "mlp.router")]

# Qwen3-Next / Qwen3.5-MoE: full attention (q_proj holds the query and its output gate, as stored by
# both sides), gated DeltaNet (``ssm_*``), the norm before the MLP ``post_attention_norm``, a gated
# shared expert
_LINEAR_ATTN_BLOCK = _ATTENTION + [
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
    ("ssm_conv1d", "linear_attn.conv1d"),
    ("ssm_norm", "linear_attn.norm"),
    ("ssm_out", "linear_attn.out_proj"),
] + _shexp("mlp.shared_expert")
# Qwen3-Next fuses the DeltaNet inputs (in_proj_qkvz: attn_qkv + attn_gate, rebuilt by the source);
# the dense MLP only for mlp_only_layers, which llama.cpp's qwen3next has no loader for
_QWEN3NEXT_BLOCK = _LINEAR_ATTN_BLOCK + _DENSE_MLP + [("ssm_ba", "linear_attn.in_proj_ba")]
# Qwen3.5-MoE keeps them apart (every layer sparse)
_QWEN35MOE_BLOCK = _LINEAR_ATTN_BLOCK + [
    ("attn_qkv", "linear_attn.in_proj_qkv"),
    ("attn_gate", "linear_attn.in_proj_z"),
    ("ssm_alpha", "linear_attn.in_proj_a"),
    ("ssm_beta", "linear_attn.in_proj_b"),
]
_SSM_LEAVES = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}

# DeepSeek-V4: low-rank query and grouped low-rank output, one shared KV head, the compressor of
# compressed layers and the indexer (with its own compressor) of compressed-sparse ones
_DEEPSEEK4_BLOCK = [
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q_a", "self_attn.q_a_proj"),
    ("attn_q_a_norm", "self_attn.q_a_norm"),
    ("attn_q_b", "self_attn.q_b_proj"),
    ("attn_kv", "self_attn.kv_proj"),
    ("attn_kv_a_norm", "self_attn.kv_norm"),
    ("attn_output_a", "self_attn.o_a_proj"),
    ("attn_output_b", "self_attn.o_b_proj"),
    ("attn_compressor_kv", "self_attn.compressor.kv_proj"),
    ("attn_compressor_gate", "self_attn.compressor.gate_proj"),
    ("attn_compressor_norm", "self_attn.compressor.kv_norm"),
    ("indexer_compressor_kv", "self_attn.compressor.indexer.kv_proj"),
    ("indexer_compressor_gate", "self_attn.compressor.indexer.gate_proj"),
    ("indexer_compressor_norm", "self_attn.compressor.indexer.kv_norm"),
    ("indexer.attn_q_b", "self_attn.compressor.indexer.q_b_proj"),
    ("indexer.proj", "self_attn.compressor.indexer.scorer.weights_proj"),
    ("ffn_gate_inp", "mlp.gate"),
] + _shexp("mlp.shared_experts")

#: full leaves outside the ``.weight`` / ``.bias`` pattern: gpt-oss's attention sinks (a bare parameter)
#: and its per-expert biases; DeepSeek-V4's sinks, compressor position biases, hyper-connection
#: parameters and hash-router table
_EXTRA_LEAVES = {
    "gpt-oss": {
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
        "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    },
    "qwen3next": _SSM_LEAVES,
    "qwen35moe": _SSM_LEAVES,
    "deepseek4": {
        "attn_sinks.weight": "self_attn.sinks",
        "attn_compressor_ape.weight": "self_attn.compressor.position_bias",
        "indexer_compressor_ape.weight": "self_attn.compressor.indexer.position_bias",
        "ffn_gate_tid2eid.weight": "mlp.gate.tid2eid",
        **{f"hc_{g}_{p}.weight": f"{g}_hc.{p}" for g in ("attn", "ffn") for p in ("fn", "base", "scale")},
    },
}
#: top-level tensors beyond token_embd / output_norm / output (DeepSeek-V4's hyper-connection head)
_EXTRA_TOP = {"deepseek4": [(f"output_hc_{p}.weight", f"model.hc_head.hc_{p}") for p in ("fn", "base", "scale")]}

_BLOCK_TABLES = {
    "llama": _COMMON_BLOCK,
    "qwen2": _COMMON_BLOCK,
    "qwen3": _COMMON_BLOCK,
    "qwen2moe": _COMMON_BLOCK + _shexp("mlp.shared_expert") + [("ffn_gate_inp_shexp", "mlp.shared_expert_gate")],
    "qwen3moe": _COMMON_BLOCK,
    # Qwen3-VL-MoE's language model (llama.cpp writes it beside an mmproj file: weights/mmproj.py)
    "qwen3vlmoe": _COMMON_BLOCK,
    "deepseek2": _COMMON_BLOCK + _MLA_BLOCK + _shexp("mlp.shared_experts") + _NEXTN,
    "deepseek32": _COMMON_BLOCK + _MLA_BLOCK + _shexp("mlp.shared_experts") + _INDEXER + _NEXTN,
    "glm-dsa": _COMMON_BLOCK + _MLA_BLOCK + _shexp("mlp.shared_experts") + _INDEXER + _NEXTN,
    "gemma3": _GEMMA3_BLOCK,
    "glm4moe": _GLM4MOE_BLOCK + _NEXTN,
    "minimax-m2": _COMMON_BLOCK,
    "gpt-oss": _GPT_OSS_BLOCK,
    "qwen3next": _QWEN3NEXT_BLOCK,
    "qwen35moe": _QWEN35MOE_BLOCK,
    "deepseek4": _DEEPSEEK4_BLOCK,
}

#: architectures whose MTP block the name table maps (the drafter's: generation/mtp.py)
NEXTN_ARCHS = tuple(a for a, table in _BLOCK_TABLES.items() if _NEXTN[0] in table)

_TOP = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]

EXPERT_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
EXPERT_HF = {v: k for k, v in EXPERT_GGUF.items()}
#: per-expert GGUF tensors of older Mixtral files: ``blk.N.ffn_gate.E.weight``
PER_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")

_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# one tensor per expert (older Mixtral files), the part below the layer, in either naming
_GGUF_EXPERT_LEAF = re.compile(r"^ffn_(?P<proj>gate|up|down)\.(?P<e>\d+)\.weight$")
_HF_EXPERT_LEAF = re.compile(r"^mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def _translate(name: str, top: dict, block_re, leaves: dict, block_fmt: str, expert_re, expert_fmt: str):
    """One direction of the name table: top-level names, per-layer leaves, per-expert tensors."""
    if name in top:
        return top[name]
    m = block_re.match(name)
    if m is None:
        return None
    layer, rest = m.group(1), m.group(2)
    leaf = leaves.get(rest)
    if leaf is not None:
        return block_fmt.format(layer=layer, leaf=leaf)
    pe = expert_re.match(rest)
    return expert_fmt.format(layer=layer, **pe.groupdict()) if pe else None


@dataclass(frozen=True)
class NameMap:
    """Bidirectional name table for one architecture."""

    arch: str

    def __post_init__(self):
        if self.arch not in _BLOCK_TABLES:
            raise KeyError(f"architecture {self.arch!r} has no name table (supported: {', '.join(SUPPORTED_ARCHS)})")
        g2h: dict[str, str] = {}
        for g, h in _BLOCK_TABLES[self.arch]:
            for suf in (".weight", ".bias"):
                g2h[g + suf] = h + suf
        g2h["exp_probs_b.bias"] = _EXP_PROBS_B.get(self.arch, "mlp.gate.e_score_correction_bias")
        for hf_leaf, g in EXPERT_GGUF.items():
            g2h[f"{g}.weight"] = f"mlp.experts.{hf_leaf}"
        g2h.update(_EXTRA_LEAVES.get(self.arch, {}))
        object.__setattr__(self, "_g2h", g2h)
        object.__setattr__(self, "_h2g", {h: g for g, h in g2h.items()})
        top = _TOP + _EXTRA_TOP.get(self.arch, [])
        object.__setattr__(self, "_top_g2h", dict(top))
        object.__setattr__(self, "_top_h2g", {h: g for g, h in top})

    def gguf_to_hf(self, name: str) -> str | None:
        return _translate(name, self._top_g2h, _BLK_RE, self._g2h, "model.layers.{layer}.{leaf}",
                          _GGUF_EXPERT_LEAF, "model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight")

    def hf_to_gguf(self, name: str) -> str | None:
        return _translate(name, self._top_h2g, _HF_RE, self._h2g, "blk.{layer}.{leaf}",
                          _HF_EXPERT_LEAF, "blk.{layer}.ffn_{proj}.{e}.weight")


def name_map(arch: str) -> NameMap:
    return NameMap(arch)


def glm4moe_metadata(c, head_dim: int) -> dict[str, tuple[str, object]]:
    """The ``glm4moe.*`` keys llama.cpp's converter writes beyond the common ones (partial rotary,
    sigmoid routing, dense first layers, shared experts)."""
    A = "glm4moe"
    rope_dim = int(head_dim * c.rope_parameters.get("partial_rotary_factor", 0.5))
    return {
        f"{A}.rope.dimension_count": ("u32", rope_dim),
        f"{A}.expert_count": ("u32", c.n_routed_experts),
        f"{A}.expert_used_count": ("u32", c.num_experts_per_tok),
        f"{A}.expert_feed_forward_length": ("u32", c.moe_intermediate_size),
        f"{A}.expert_shared_count": ("u32", c.n_shared_experts),
        f"{A}.leading_dense_block_count": ("u32", c.first_k_dense_replace),
        f"{A}.expert_gating_func": ("u32", 2),  # sigmoid
        f"{A}.expert_weights_scale": ("f32", float(c.routed_scaling_factor)),
        f"{A}.expert_weights_norm": ("bool", bool(c.norm_topk_prob)),
        f"{A}.expert_group_count": ("u32", c.n_group),
        f"{A}.expert_group_used_count": ("u32", c.topk_group),
    }


def dsa_metadata(c, A: str) -> dict[str, tuple[str, object]]:
    """The ``attention.indexer.*`` keys llama.cpp's converter writes beyond the ``deepseek2`` ones
    (GLM-5: which layers run their own indexer, as booleans)."""
    md = {
        f"{A}.attention.indexer.head_count": ("u32", c.index_n_heads),
        f"{A}.attention.indexer.key_length": ("u32", c.index_head_dim),
        f"{A}.attention.indexer.top_k": ("u32", c.index_topk),
    }
    if getattr(c, "indexer_types", None) is not None:
        md[f"{A}.attention.indexer.types"] = ("arr", [t == "full" for t in c.indexer_types])
    return md


def minimax_m2_metadata(c, head_dim: int) -> dict[str, tuple[str, object]]:
    """The ``minimax-m2.*`` keys llama.cpp's converter writes beyond the common ones."""
    A = "minimax-m2"
    return {
        f"{A}.attention.key_length": ("u32", head_dim),
        f"{A}.attention.value_length": ("u32", head_dim),
        f"{A}.rope.dimension_count": ("u32", int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))),
        f"{A}.expert_count": ("u32", c.num_local_experts),
        f"{A}.expert_used_count": ("u32", c.num_experts_per_tok),
        f"{A}.expert_feed_forward_length": ("u32", c.intermediate_size),
        f"{A}.expert_gating_func": ("u32", 2),  # sigmoid
    }


def gpt_oss_metadata(c, head_dim: int) -> dict[str, tuple[str, object]]:
    """The ``gpt-oss.*`` keys llama.cpp's converter writes beyond the common ones."""
    A = "gpt-oss"
    return {
        f"{A}.attention.key_length": ("u32", head_dim),
        f"{A}.attention.value_length": ("u32", head_dim),
        f"{A}.attention.sliding_window": ("u32", c.sliding_window),
        f"{A}.expert_count": ("u32", c.num_local_experts),
        f"{A}.expert_used_count": ("u32", c.num_experts_per_tok),
        f"{A}.expert_feed_forward_length": ("u32", c.intermediate_size),
    }


#: the MRoPE sections llama.cpp's converter writes for Qwen3.5 when the config has none (transformers'
#: default too); text-only positions are equal on every axis, so they do not change the result
QWEN35_MROPE_SECTIONS = [11, 11, 10, 0]


def linear_attn_metadata(c, head_dim: int, A: str) -> dict[str, tuple[str, object]]:
    """The ``qwen3next.*`` / ``qwen35moe.*`` keys llama.cpp's converter writes beyond the common ones
    (DeltaNet sizes as ``ssm.*``, which layers are recurrent, partial rotary, the shared expert's
    width; Qwen3.5: the MRoPE sections, no dense ``feed_forward_length``)."""
    rope = getattr(c, "rope_parameters", None) or {}
    md = {
        f"{A}.attention.key_length": ("u32", head_dim),
        f"{A}.attention.value_length": ("u32", head_dim),
        f"{A}.rope.dimension_count": ("u32", int(head_dim * rope.get("partial_rotary_factor", 0.25))),
        f"{A}.expert_count": ("u32", c.num_experts),
        f"{A}.expert_used_count": ("u32", c.num_experts_per_tok),
        f"{A}.expert_feed_forward_length": ("u32", c.moe_intermediate_size),
        f"{A}.expert_shared_feed_forward_length": ("u32", c.shared_expert_intermediate_size),
        f"{A}.ssm.conv_kernel": ("u32", c.linear_conv_kernel_dim),
        f"{A}.ssm.state_size": ("u32", c.linear_key_head_dim),
        f"{A}.ssm.group_count": ("u32", c.linear_num_key_heads),
        f"{A}.ssm.time_step_rank": ("u32", c.linear_num_value_heads),
        f"{A}.ssm.inner_size": ("u32", c.linear_value_head_dim * c.linear_num_value_heads),
        f"{A}.attention.recurrent_layers": ("arr", [t == "linear_attention" for t in c.layer_types]),
        f"{A}.full_attention_interval": ("u32", int(getattr(c, "full_attention_interval", None) or 4)),
    }
    if A == "qwen35moe":
        sections = list(rope.get("mrope_section") or QWEN35_MROPE_SECTIONS)
        md[f"{A}.rope.dimension_sections"] = ("arr", (sections + [0] * 4)[:4])
    return md


def deepseek4_metadata(c, head_dim: int) -> dict[str, tuple[str, object]]:
    """The ``deepseek4.*`` keys llama.cpp's converter writes beyond the common ones (compress
    ratios per layer, hyper-connection sizes, hash layers, per-layer swiglu clamps, the indexer,
    the grouped low-rank output); no ``feed_forward_length``."""
    A = "deepseek4"
    n = c.num_hidden_layers
    rates = c.compress_rates or {}
    return {
        f"{A}.attention.key_length": ("u32", head_dim),
        f"{A}.attention.value_length": ("u32", head_dim),
        f"{A}.rope.dimension_count": ("u32", c.qk_rope_head_dim),
        f"{A}.attention.q_lora_rank": ("u32", c.q_lora_rank),
        f"{A}.attention.sliding_window": ("u32", c.sliding_window),
        f"{A}.expert_count": ("u32", c.n_routed_experts),
        f"{A}.expert_used_count": ("u32", c.num_experts_per_tok),
        f"{A}.expert_gating_func": ("u32", 4),  # sqrtsoftplus, the only one llama.cpp loads
        f"{A}.expert_feed_forward_length": ("u32", c.moe_intermediate_size),
        f"{A}.expert_shared_count": ("u32", c.n_shared_experts),
        f"{A}.expert_weights_scale": ("f32", float(c.routed_scaling_factor)),
        f"{A}.expert_weights_norm": ("bool", bool(c.norm_topk_prob)),
        f"{A}.swiglu_clamp_exp": ("f32arr", [float(c.swiglu_limit)] * n),
        f"{A}.swiglu_clamp_shexp": ("f32arr", [float(c.swiglu_limit)] * n),
        f"{A}.attention.indexer.head_count": ("u32", c.index_n_heads),
        f"{A}.attention.indexer.key_length": ("u32", c.index_head_dim),
        f"{A}.attention.indexer.top_k": ("u32", c.index_topk),
        f"{A}.attention.output_group_count": ("u32", c.o_groups),
        f"{A}.attention.output_lora_rank": ("u32", c.o_lora_rank),
        f"{A}.attention.compress_ratios": ("arr", [int(rates.get(t, 0)) for t in c.layer_types]),
        f"{A}.attention.compress_rope_freq_base": ("f32", float(c.compress_rope_theta)),
        f"{A}.hyper_connection.count": ("u32", c.hc_mult),
        f"{A}.hyper_connection.sinkhorn_iterations": ("u32", c.hc_sinkhorn_iters),
        f"{A}.hyper_connection.epsilon": ("f32", float(c.hc_eps)),
        f"{A}.hash_layer_count": ("u32", list(c.mlp_layer_types).count("hash_moe")),
        f"{A}.embedding_length_out": ("u32", c.hidden_size * c.hc_mult),
    }


# ------------------------------------------------------------------------- value transforms


def permute_qk(w: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (HF -> GGUF row order of attn_q / attn_k, weight or bias)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """Inverse of :func:`permute_qk` (GGUF -> HF)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qk_row_order(rows: int, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """Index ``idx`` with ``hf_rows = gguf_rows[idx]`` (for reordering quantized rows of llama Q/K)."""
    import torch

    return unpermute_qk(torch.arange(rows), n_head, n_head_kv)


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """HF ``kv_b_proj.weight [H*(nope+v), r]`` from llama.cpp's ``attn_k_b [H, nope, r]`` (stored as
    ``k_b[h] = kv_b[h, :nope, :].T`` i.e. torch ``[H, r, nope]``) and ``attn_v_b [H, v, r]``."""
    n_head, r, nope = k_b.shape
    assert v_b.shape[0] == n_head and v_b.shape[2] == r, (k_b.shape, v_b.shape)
    import torch

    per_head = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope+v, r]
    return per_head.reshape(n_head * (nope + v_b.shape[1]), r).contiguous()


def split_kv_b(kv_b: torch.Tensor, n_head: int, nope: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`kv_b_from_split`: (k_b torch ``[H, r, nope]``, v_b ``[H, v, r]``)."""
    r = kv_b.shape[1]
    per_head = kv_b.reshape(n_head, nope + v, r)
    return per_head[:, :nope, :].transpose(1, 2).contiguous(), per_head[:, nope:, :].contiguous()


def is_gemma_norm(gguf_name: str) -> bool:
    return gguf_name.endswith("norm.weight")


#: architectures whose RMSNorm weights llama.cpp stores as ``w + 1``
NORM_OFFSET_ARCHS = ("gemma3",) + LINEAR_ATTN_ARCHS


def has_norm_offset(arch: str, gguf_name: str) -> bool:
    """Whether llama.cpp stores this tensor as the HF weight + 1 (zero-centred RMSNorm weights)."""
    if arch in LINEAR_ATTN_ARCHS and gguf_name.endswith(".ssm_norm.weight"):
        return False
    return arch in NORM_OFFSET_ARCHS and is_gemma_norm(gguf_name)


def qwen3next_linear_dims(n_k_heads: int, k_dim: int, n_v_heads: int, v_dim: int) -> tuple[int, int, int]:
    """(key heads, per-key-head [q, k, v, z] block rows, rows of q + k + v) of a Qwen3-Next DeltaNet."""
    vz = n_v_heads // n_k_heads * v_dim
    return n_k_heads, 2 * k_dim + 2 * vz, n_k_heads * (2 * k_dim + vz)


def _tiled_v_order(n_k_heads: int, n_v_heads: int, head_dim: int) -> torch.Tensor:
    """Index ``idx`` with ``grouped = tiled[idx]`` for V heads of ``head_dim`` rows."""
    import torch

    return torch.arange(n_v_heads * head_dim).view(n_v_heads // n_k_heads, n_k_heads, head_dim) \
        .transpose(0, 1).reshape(-1)


def v_head_orders(n_k_heads: int, k_dim: int, n_v_heads: int, v_dim: int) -> dict[str, tuple[int, torch.Tensor]]:
    """Qwen3.5's DeltaNet: llama.cpp's converter (``_LinearAttentionVReorderBase``) stores the V heads
    tiled (``[K0, K1, .., K0, K1, ..]``, for ggml's broadcast) where HF groups them per key head.  Per
    HF leaf, ``(dim, idx)`` with ``hf = stored.index_select(dim, idx)`` (``idx.argsort()`` writes);
    empty when each key head has one V head."""
    import torch

    if n_k_heads == n_v_heads:
        return {}
    qk = 2 * n_k_heads * k_dim  # q and k channels come first, as they are
    mixed = torch.cat([torch.arange(qk), qk + _tiled_v_order(n_k_heads, n_v_heads, v_dim)])
    values, heads = _tiled_v_order(n_k_heads, n_v_heads, v_dim), _tiled_v_order(n_k_heads, n_v_heads, 1)
    return {
        "linear_attn.in_proj_qkv.weight": (0, mixed),
        "linear_attn.conv1d.weight": (0, mixed),
        "linear_attn.in_proj_z.weight": (0, values),
        "linear_attn.in_proj_a.weight": (0, heads),
        "linear_attn.in_proj_b.weight": (0, heads),
        "linear_attn.A_log": (0, heads),
        "linear_attn.dt_bias": (0, heads),
        "linear_attn.out_proj.weight": (1, values),
    }


def qkvz_row_order(n_k_heads: int, k_dim: int, n_v_heads: int, v_dim: int) -> torch.Tensor:
    """Index ``idx`` with ``in_proj_qkvz rows = cat(attn_qkv, attn_gate) rows[idx]`` (llama.cpp's
    ``Qwen3NextModel.modify_tensors`` undone; whole rows, so it serves quantized rows too)."""
    import torch

    vz = n_v_heads // n_k_heads * v_dim
    nq = n_k_heads * k_dim
    ar = torch.arange(2 * nq + 2 * n_k_heads * vz)
    q = ar[:nq].view(n_k_heads, k_dim)
    k = ar[nq:2 * nq].view(n_k_heads, k_dim)
    v = ar[2 * nq:2 * nq + n_k_heads * vz].view(n_k_heads, vz)
    z = ar[2 * nq + n_k_heads * vz:].view(n_k_heads, vz)
    return torch.cat([q, k, v, z], dim=1).reshape(-1)


def split_qkvz(w, n_k_heads: int, k_dim: int, n_v_heads: int, v_dim: int):
    """HF ``in_proj_qkvz.weight`` -> (``attn_qkv``, ``attn_gate``) rows, llama.cpp's order."""
    inv = qkvz_row_order(n_k_heads, k_dim, n_v_heads, v_dim).argsort()
    rows = w[inv.numpy()] if not hasattr(w, "device") else w[inv.to(w.device)]
    n_qkv = qwen3next_linear_dims(n_k_heads, k_dim, n_v_heads, v_dim)[2]
    return rows[:n_qkv], rows[n_qkv:]


#: GGUF tensors some writers store 1-D although HF holds a one-row matrix (qwen2moe's shared-expert
#: gate: llama.cpp reads it as ``[n_embd]`` and converters write either ``[n_embd]`` or ``[1, n_embd]``)
_ONE_ROW = re.compile(r"\.ffn_gate_inp_shexp\.weight$")


def hf_shape(gguf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape the HF model gives a stored GGUF tensor (usually the stored one)."""
    if len(shape) == 1 and _ONE_ROW.search(gguf_name):
        return (1, *shape)
    if len(shape) == 2 and gguf_name.endswith(".ssm_conv1d.weight"):  # depthwise conv: [C, 1, K]
        return (shape[0], 1, shape[1])
    return tuple(shape)
