"""Hugging Face safetensors model -> GGUF file with llama.cpp names and metadata.

    python -m ktransformers.convert --model_path HF_DIR --output OUT.gguf \\
        --experts Q4_K --attention Q8_0 --default Q6_K [--embeddings Q8_0] [--output-type Q6_K] [--norms F32]

Architectures: llama (and Mixtral, written as llama.cpp does: ``llama`` arch with ``ffn_*_exps``),
qwen2, qwen3, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3 (split MLA ``attn_k_b``/``attn_v_b``
like current llama.cpp), gemma3 (text), qwen3_next and qwen3_5_moe_text (``qwen35moe``, the DeltaNet's V heads reordered as
llama.cpp does) as llama.cpp's converter with ``--no-mtp`` (the MTP block is not part of the
transformers model), deepseek_v4 (``deepseek4``: the hash
router's ``tid2eid`` tables I32; llama.cpp's converter writes the routed experts MXFP4, which
``--experts MXFP4`` matches).

Type policy, like llama-quantize's: routed experts ``--experts``; attention projections
``--attention``; ``token_embd`` ``--embeddings``; ``output`` ``--output-type``; everything else 2-D
``--default`` (MXFP4 through gguf-py's quantizer); 1-D tensors (norms, biases), the router ``ffn_gate_inp`` and ``exp_probs_b`` stay
``--norms`` (F32).  Rows that are not a multiple of a 256-value block fall back like
llama-quantize: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0, IQ4_XS -> IQ4_NL;
rows not a multiple of 32 -> F16.

Tensors are streamed: each is read, transformed and quantized (stacked experts one expert at a time)
on a worker thread, two ahead of the one being written, so memory stays near three tensors' size.  A byte-level
BPE ``tokenizer.json`` in the folder is written as llama.cpp's ``gpt2`` vocabulary, a SentencePiece
``tokenizer.model`` as its ``llama`` vocabulary (Llama and Gemma-3 prefer the latter, as llama.cpp's
converter does); otherwise the file says ``tokenizer.ggml.model = "no_vocab"``.

``--preset Q4_K_M`` (or Q2_K, Q3_K_S/M/L, Q4_K_S, Q5_K_S/M, Q6_K, Q8_0, Q4_0, IQ4_NL, IQ4_XS, ...)
replaces the per-role types with llama-quantize's own per-tensor mix for that preset (see
:class:`PresetPolicy`).  Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS are quantized in C++ on all cores
(``KT_QUANT_THREADS``), with a progress bar.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .errors import ConfigError, KTError, WeightError
from .weights import gguf_names as gn
from .weights.ggml_types import FILE_TYPES, ggml_type_info
from .weights.quantize import QUANTIZABLE, native_quantizer, quantize
from .weights.safetensors_header import read_header

#: llama-quantize's type for rows that are not a multiple of a 256-value block
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


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
        if t in ("F32", "F16", "BF16"):
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
    """The type actually written for rows of ``row`` values (llama-quantize's fallbacks)."""
    info = ggml_type_info(t)
    if row % info.block_elems == 0:
        return info.name
    if t in _FALLBACK and row % 32 == 0:
        return _FALLBACK[t]
    if info.block_elems > 1:
        return "F16"
    return info.name


# ------------------------------------------------------------------------------ checkpoint


class _LightUnsupported(Exception):
    """The light path (no torch, no transformers) cannot vouch for this folder: convert it with transformers."""


class _TorchFiles:
    """Safetensors files through the safetensors library (torch tensors, every stored dtype)."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles, self.where = {}, {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:
                raise WeightError(f"{f}: unreadable safetensors file ({e})") from e
            self._handles[f] = h
            for k in h.keys():
                self.where[k] = f

    def get(self, key: str, index: int | None = None):
        import torch

        h = self._handles[self.where[key]]
        t = h.get_tensor(key) if index is None else h.get_slice(key)[index]
        return t.to(torch.float32)


class _NumpyFiles:
    """Safetensors files read without torch: the header from :func:`read_header`, the data mapped with numpy.
    Only float32/float16/bfloat16 tensors (others: :class:`_LightUnsupported`)."""

    _DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

    def __init__(self, files: list[Path]):
        self.where, self._info, self._maps = {}, {}, {}
        for f in files:
            header = read_header(f)
            mm = np.memmap(f, dtype=np.uint8, mode="r")
            for k, e in header.items():
                if e.dtype not in self._DTYPES:
                    raise _LightUnsupported(f"{k}: dtype {e.dtype}")
                self.where[k] = f
                self._info[k] = (e.dtype, e.shape, e.start, e.end)
                self._maps[k] = mm

    def shape(self, key: str) -> tuple[int, ...]:
        return self._info[key][1]

    def get(self, key: str, index: int | None = None) -> np.ndarray:
        dtype, shape, b0, b1 = self._info[key]
        a = self._maps[key][b0:b1].view(self._DTYPES[dtype]).reshape(shape)
        if index is not None:
            a = a[index]
        if dtype == "F32":
            return np.array(a)
        a = np.ascontiguousarray(a)
        out = np.empty(a.shape, dtype=np.float32)
        ext = native_quantizer()
        if ext is not None:  # F16C / AVX2 conversion, without the GIL
            ext.dequantize(ggml_type_info(dtype).id, a.ctypes.data, a.size, out.ctypes.data)
        elif dtype == "BF16":  # bfloat16 is the top half of a float32
            out[...] = (a.astype(np.uint32) << 16).view(np.float32)
        else:
            out[...] = a
        return out


class Checkpoint:
    """Lazy float32 tensors of an HF safetensors folder, by canonical transformers 5 names.

    Accepts per-expert keys (``experts.E.gate_proj.weight``), fused/stacked keys
    (``experts.gate_up_proj``), Mixtral's original ``block_sparse_moe.experts.E.w1/w2/w3`` and
    DeepSeek-V4's release names (what its ``save_pretrained`` writes; the safetensors source's renamer).
    ``light=True`` reads them as numpy arrays without importing torch (:class:`_NumpyFiles`).
    """

    def __init__(self, path: Path, light: bool = False):
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightError(f"{path}: no .safetensors files")
        self.path = path
        self.files = _NumpyFiles(files) if light else _TorchFiles(files)
        self._where = self.files.where
        self.keys = set(self._where)
        rename = None
        if not light:  # the safetensors source imports torch
            from .weights.safetensors_source import _release_renamer

            rename = _release_renamer(list(self._where))
        self._renamed = {rename(k): k for k in self._where} if rename else {}

    def _alias(self, name: str) -> str | None:
        if name in self._where:
            return name
        alt = name.replace(".mlp.", ".block_sparse_moe.")
        alt = re.sub(r"\.experts\.(\d+)\.gate_proj\.", r".experts.\1.w1.", alt)
        alt = re.sub(r"\.experts\.(\d+)\.down_proj\.", r".experts.\1.w2.", alt)
        alt = re.sub(r"\.experts\.(\d+)\.up_proj\.", r".experts.\1.w3.", alt)
        if alt in self._where:
            return alt
        for n in (name, alt.replace(".block_sparse_moe.", ".mlp.")):
            if n in self._renamed:
                return self._renamed[n]
        return None

    def has(self, name: str) -> bool:
        return self._alias(name) is not None

    def get(self, name: str):
        key = self._alias(name)
        if key is None:
            raise WeightError(f"{self.path}: tensor '{name}' not found in the checkpoint")
        return self.files.get(key)

    def expert(self, base: str, proj: str, e: int, n_inter: int):
        """One expert's [out, in] matrix of ``proj`` (gate_proj/up_proj/down_proj) below ``base``."""
        per = f"{base}.{e}.{proj}.weight"
        if self.has(per):
            return self.get(per)
        if proj in ("gate_proj", "up_proj") and self.has(f"{base}.gate_up_proj"):
            fused = self.files.get(self._alias(f"{base}.gate_up_proj"), e)
            return fused[:n_inter] if proj == "gate_proj" else fused[n_inter:]
        if self.has(f"{base}.{proj}"):
            return self.files.get(self._alias(f"{base}.{proj}"), e)
        raise WeightError(f"{self.path}: no weights for expert {e} of {base}.{proj}")


# ------------------------------------------------------------------------------ plan


@dataclass
class _Out:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: str
    produce: Callable[[], np.ndarray]  # -> flat uint8 bytes

    @property
    def nbytes(self) -> int:
        return ggml_type_info(self.ggml_type).nbytes(self.shape)


def _model_params(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the transformers model of ``config`` (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def _arch_of(config) -> str:
    mt = config.model_type
    if mt == "gemma3":
        config = config.get_text_config()
        mt = config.model_type
    arch = gn.MODEL_TYPE_TO_ARCH.get(mt)
    if mt in gn.NOT_WRITTEN:
        raise ConfigError(f"cannot convert model_type '{mt}': {gn.NOT_WRITTEN[mt]}")
    if arch is None:
        raise ConfigError(f"cannot convert model_type '{mt}' (supported: {', '.join(sorted(gn.MODEL_TYPE_TO_ARCH))})")
    return arch


def metadata_for(config, arch: str, tensor_names: Iterable[str]) -> dict[str, tuple[str, object]]:
    """llama.cpp metadata keys for ``config``: {key: (gguf value kind, value)}."""
    c = config
    A = arch
    md: dict[str, tuple[str, object]] = {
        "general.architecture": ("str", A),
        "general.name": ("str", getattr(c, "_name_or_path", "") or A),
        "general.quantization_version": ("u32", 2),
        f"{A}.block_count": ("u32", c.num_hidden_layers),
        f"{A}.context_length": ("u32", c.max_position_embeddings),
        f"{A}.embedding_length": ("u32", c.hidden_size),
        f"{A}.attention.head_count": ("u32", c.num_attention_heads),
        f"{A}.attention.head_count_kv": ("u32", getattr(c, "num_key_value_heads", c.num_attention_heads)),
        f"{A}.attention.layer_norm_rms_epsilon": ("f32", c.rms_norm_eps),
        f"{A}.vocab_size": ("u32", c.vocab_size),
        "tokenizer.ggml.model": ("str", "no_vocab"),
    }
    if getattr(c, "intermediate_size", None) is not None:  # Qwen3.5-MoE has no dense MLP
        md[f"{A}.feed_forward_length"] = ("u32", c.intermediate_size)
    rp = getattr(c, "rope_parameters", None) or {}
    if A == "gemma3":
        rp = rp.get("full_attention", rp)
    if A == "deepseek4":  # the main rope's base; scaling (if any) is the compressed layers'
        rp = {**rp.get("compress", {}), "rope_theta": rp.get("main", {}).get("rope_theta", c.rope_theta)}
    md[f"{A}.rope.freq_base"] = ("f32", float(rp.get("rope_theta", 10000.0)))
    rtype = rp.get("rope_type", "default")
    if rtype in ("linear", "yarn"):
        md[f"{A}.rope.scaling.type"] = ("str", rtype)
        md[f"{A}.rope.scaling.factor"] = ("f32", float(rp["factor"]))
        if rtype == "yarn":
            if rp.get("original_max_position_embeddings"):
                md[f"{A}.rope.scaling.original_context_length"] = ("u32", int(rp["original_max_position_embeddings"]))
            if rp.get("mscale_all_dim"):
                md[f"{A}.rope.scaling.yarn_log_multiplier"] = ("f32", 0.1 * float(rp["mscale_all_dim"]))
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(c, tok, None)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            key = "padding_token_id" if tok == "pad_token_id" else tok
            md[f"tokenizer.ggml.{key}"] = ("u32", int(v))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if A in ("llama",):
        md[f"{A}.rope.dimension_count"] = ("u32", head_dim)
        if getattr(c, "head_dim", None) and c.head_dim != c.hidden_size // c.num_attention_heads:
            md[f"{A}.attention.key_length"] = ("u32", head_dim)
            md[f"{A}.attention.value_length"] = ("u32", head_dim)
        if getattr(c, "num_local_experts", 0):
            md[f"{A}.expert_count"] = ("u32", c.num_local_experts)
            md[f"{A}.expert_used_count"] = ("u32", c.num_experts_per_tok)
    if A in ("qwen3", "qwen3moe", "gemma3", "glm4moe"):
        md[f"{A}.attention.key_length"] = ("u32", head_dim)
        md[f"{A}.attention.value_length"] = ("u32", head_dim)
    if A in ("qwen2moe", "qwen3moe"):
        md[f"{A}.expert_count"] = ("u32", c.num_experts)
        md[f"{A}.expert_used_count"] = ("u32", c.num_experts_per_tok)
        md[f"{A}.expert_feed_forward_length"] = ("u32", c.moe_intermediate_size)
        if A == "qwen2moe":
            md[f"{A}.expert_shared_feed_forward_length"] = ("u32", c.shared_expert_intermediate_size)
    if A in gn.MLA_ARCHS:
        rope = c.qk_rope_head_dim
        md.update({
            f"{A}.attention.head_count_kv": ("u32", 1),
            f"{A}.attention.key_length": ("u32", c.kv_lora_rank + rope),
            f"{A}.attention.value_length": ("u32", c.kv_lora_rank),
            f"{A}.attention.key_length_mla": ("u32", c.qk_nope_head_dim + rope),
            f"{A}.attention.value_length_mla": ("u32", c.v_head_dim),
            f"{A}.attention.kv_lora_rank": ("u32", c.kv_lora_rank),
            f"{A}.rope.dimension_count": ("u32", rope),
            f"{A}.leading_dense_block_count": ("u32", c.first_k_dense_replace),
            f"{A}.expert_count": ("u32", c.n_routed_experts),
            f"{A}.expert_used_count": ("u32", c.num_experts_per_tok),
            f"{A}.expert_feed_forward_length": ("u32", c.moe_intermediate_size),
            f"{A}.expert_shared_count": ("u32", c.n_shared_experts or 0),
            f"{A}.expert_weights_scale": ("f32", float(c.routed_scaling_factor)),
            f"{A}.expert_weights_norm": ("bool", bool(c.norm_topk_prob)),
            f"{A}.expert_group_count": ("u32", c.n_group or 1),
            f"{A}.expert_group_used_count": ("u32", c.topk_group or 1),
        })
        if c.q_lora_rank:
            md[f"{A}.attention.q_lora_rank"] = ("u32", c.q_lora_rank)
        sigmoid = c.model_type == "deepseek_v3" or getattr(c, "scoring_func", "softmax") == "sigmoid"
        md[f"{A}.expert_gating_func"] = ("u32", 2 if sigmoid or A in gn.DSA_ARCHS else 1)
    if A in gn.DSA_ARCHS:
        md.update(gn.dsa_metadata(c, A))
    if A == "gemma3":
        md[f"{A}.attention.sliding_window"] = ("u32", c.sliding_window)
    if A == "glm4moe":
        md.update(gn.glm4moe_metadata(c, head_dim))
    if A == "minimax-m2":
        md.update(gn.minimax_m2_metadata(c, head_dim))
    if A in gn.LINEAR_ATTN_ARCHS:
        md.update(gn.linear_attn_metadata(c, head_dim, A))
    if A == "deepseek4":
        del md[f"{A}.feed_forward_length"]
        md.update(gn.deepseek4_metadata(c, head_dim))
    return md


def plan(config, ckpt: Checkpoint, policy: TypePolicy, params=None) -> tuple[str, list[_Out]]:
    """The GGUF tensors to write for ``config``, each with a producer that reads the checkpoint.

    ``params``: the model's (name, shape) list; default: from the transformers model itself."""
    text_cfg = config.get_text_config() if config.model_type == "gemma3" else config
    arch = _arch_of(config)
    nmap = gn.name_map(arch)
    if params is None:
        params = _model_params(text_cfg)
    tied = bool(getattr(text_cfg, "tie_word_embeddings", False))
    outs: list[_Out] = []
    n_head = text_cfg.num_attention_heads
    n_kv = getattr(text_cfg, "num_key_value_heads", n_head)

    def ck_name(hf: str) -> str:
        if ckpt.has(hf):
            return hf
        if arch == "gemma3" and ckpt.has(hf.replace("model.", "model.language_model.", 1)):
            return hf.replace("model.", "model.language_model.", 1)
        return hf

    v_orders = gn.v_head_orders(text_cfg.linear_num_key_heads, text_cfg.linear_key_head_dim,
                                text_cfg.linear_num_value_heads, text_cfg.linear_value_head_dim) \
        if arch == "qwen35moe" else {}

    def read(src: str, hf: str):
        """The checkpoint's tensor, its V heads in llama.cpp's order (qwen35moe)."""
        w = ckpt.get(src)
        order = v_orders.get(hf.split(".", 3)[-1])
        return w if order is None else w.index_select(order[0], order[1].argsort())

    def add(gname: str, shape, fn):
        shape = tuple(int(s) for s in shape)
        t = policy.choose(gname, shape)
        outs.append(_Out(gname, shape, t, lambda fn=fn, t=t: quantize(fn(), t)))

    for hf, shape in params:
        if hf == "lm_head.weight" and tied:
            continue
        base, leaf = hf.rsplit(".", 1)
        if base.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
            E = shape[0]
            projs = [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps")] if leaf == "gate_up_proj" else [
                ("down_proj", "ffn_down_exps")]
            layer = re.match(r"model\.layers\.(\d+)\.", hf).group(1)
            n_inter = shape[1] // 2 if leaf == "gate_up_proj" else shape[2]
            for proj, g in projs:
                eshape = (shape[1] // 2, shape[2]) if leaf == "gate_up_proj" else (shape[1], shape[2])
                gname = f"blk.{layer}.{g}.weight"
                t = policy.choose(gname, (E, *eshape))
                outs.append(_Out(gname, (E, *eshape), t, _expert_producer(ckpt, ck_name(base), proj, E, n_inter, t)))
            continue
        if arch in gn.MLA_ARCHS and hf.endswith("self_attn.kv_b_proj.weight"):
            layer = re.match(r"model\.layers\.(\d+)\.", hf).group(1)
            nope, v = text_cfg.qk_nope_head_dim, text_cfg.v_head_dim
            r = shape[1]
            src = ck_name(hf)
            add(f"blk.{layer}.attn_k_b.weight", (n_head, r, nope),
                lambda src=src: gn.split_kv_b(ckpt.get(src), n_head, nope, v)[0])
            add(f"blk.{layer}.attn_v_b.weight", (n_head, v, r),
                lambda src=src: gn.split_kv_b(ckpt.get(src), n_head, nope, v)[1])
            continue
        if arch == "qwen3next" and hf.endswith("linear_attn.in_proj_qkvz.weight"):
            layer = re.match(r"model\.layers\.(\d+)\.", hf).group(1)
            dims = (text_cfg.linear_num_key_heads, text_cfg.linear_key_head_dim,
                    text_cfg.linear_num_value_heads, text_cfg.linear_value_head_dim)
            n_qkv = gn.qwen3next_linear_dims(*dims)[2]
            src = ck_name(hf)
            add(f"blk.{layer}.attn_qkv.weight", (n_qkv, shape[1]),
                lambda src=src: gn.split_qkvz(ckpt.get(src), *dims)[0])
            add(f"blk.{layer}.attn_gate.weight", (shape[0] - n_qkv, shape[1]),
                lambda src=src: gn.split_qkvz(ckpt.get(src), *dims)[1])
            continue
        gname = nmap.hf_to_gguf(hf)
        if gname is None:
            raise ConfigError(f"{ckpt.path}: no GGUF name for parameter '{hf}' of a {arch} model")
        if arch == "deepseek4" and gname.endswith(".ffn_gate_tid2eid.weight"):  # the hash router's table: I32
            src = ck_name(hf)
            outs.append(_Out(gname, tuple(shape), "I32", lambda src=src: np.ascontiguousarray(
                np.asarray(ckpt.get(src)), dtype=np.int32).reshape(-1).view(np.uint8)))
            continue
        src = ck_name(hf)
        if arch == "llama" and re.search(r"\.attn_(q|k)\.(weight|bias)$", gname):
            kv = n_head if ".attn_q." in gname else n_kv
            add(gname, shape, lambda src=src, kv=kv: gn.permute_qk(ckpt.get(src), n_head, kv))
        elif gn.has_norm_offset(arch, gname):
            add(gname, shape, lambda src=src: ckpt.get(src) + 1.0)
        elif arch in gn.LINEAR_ATTN_ARCHS and gname.endswith(".ssm_a"):
            add(gname, shape, lambda src=src, hf=hf: -read(src, hf).exp())  # llama.cpp stores A = -exp(A_log)
        elif arch in gn.LINEAR_ATTN_ARCHS and gname.endswith(".ssm_conv1d.weight"):
            add(gname, (shape[0], shape[2]), lambda src=src, hf=hf, s=shape: read(src, hf).reshape(s[0], s[2]))
        else:
            add(gname, shape, lambda src=src, hf=hf: read(src, hf))
    outs.sort(key=lambda o: _file_order(o.name))
    return arch, outs


def _file_order(gguf_name: str) -> tuple:
    """Tensors in the file: token_embd, then layer by layer (names sorted within a layer), then the rest —
    the same order whichever way the model's tensors were listed."""
    m = re.match(r"blk\.(\d+)\.", gguf_name)
    if m:
        return (1, int(m.group(1)), gguf_name)
    return (0 if gguf_name.startswith("token_embd") else 2, 0, gguf_name)


def _expert_producer(ckpt: Checkpoint, base: str, proj: str, E: int, n_inter: int, t: str):
    def produce() -> np.ndarray:
        out = None
        for e in range(E):
            q = quantize(ckpt.expert(base, proj, e, n_inter), t)
            if out is None:
                out = np.empty(E * q.size, dtype=np.uint8)
            out[e * q.size:(e + 1) * q.size] = q
        return out

    return produce


# ------------------------------------------------------------------------------ the light path

#: model types converted without importing torch or transformers (start-up in well under a second
#: instead of seconds): config.json read as written, the model's tensors listed from the safetensors
#: headers and checked against the layer structure below; anything else goes through transformers
LIGHT_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
#: config fields that are no attribute of these config classes (or whose absence means what the
#: converter assumes): a missing one reads as absent; any other missing field ends the light path
_ABSENT_MEANS_DEFAULT = ("head_dim", "num_experts", "num_local_experts", "n_routed_experts", "scoring_func",
                         "tie_word_embeddings", "_name_or_path", "attention_bias", "mlp_bias", "mlp_only_layers",
                         "decoder_sparse_step")
#: config attribute aliases of these classes (transformers' ``attribute_map``)
_CONFIG_ALIASES = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}


class _ConfigView:
    """config.json as attributes, the way the converter reads a transformers config."""

    def __init__(self, raw: dict):
        self._raw = dict(raw)
        rp = raw.get("rope_parameters")
        if rp is None:
            if raw.get("rope_scaling") or "rope_theta" not in raw:
                raise _LightUnsupported("rope parameters need transformers' standardization")
            rp = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
        self._raw["rope_parameters"] = rp

    def __getattr__(self, name: str):
        raw = self.__dict__["_raw"]
        if name in raw:
            return raw[name]
        if _CONFIG_ALIASES.get(name) in raw:
            return raw[_CONFIG_ALIASES[name]]
        if name in _ABSENT_MEANS_DEFAULT or name.startswith("__"):  # (dunders: copy/pickle protocol probes)
            raise AttributeError(name)
        raise _LightUnsupported(f"config.json has no '{name}'")

    def get_text_config(self):
        return self


def _light_roles(cfg, arch: str, layer: int) -> set[str]:
    """The tensors layer ``layer`` must have (GGUF names after ``blk.N.``, ``.weight`` dropped)."""
    roles = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"}
    if arch in ("qwen2", "qwen2moe") or getattr(cfg, "attention_bias", False):
        roles |= {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
    if getattr(cfg, "attention_bias", False) and arch == "llama":
        roles.add("attn_output.bias")
    if arch in ("qwen3", "qwen3moe"):
        roles |= {"attn_q_norm", "attn_k_norm"}
    n_exp = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    moe = n_exp > 0 and layer not in (getattr(cfg, "mlp_only_layers", None) or []) and (layer + 1) % step == 0
    if moe:
        roles |= {"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
        if arch == "qwen2moe":
            roles |= {"ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}
    else:
        roles |= {"ffn_gate", "ffn_up", "ffn_down"}
        if getattr(cfg, "mlp_bias", False):
            raise _LightUnsupported("MLP biases")
    return roles


def _checkpoint_params(cfg, ckpt: Checkpoint, arch: str) -> list[tuple[str, tuple[int, ...]]]:
    """The model's (name, shape) list read from the checkpoint's own keys (canonical transformers 5
    names, per-expert matrices stacked as the model stacks them), checked for completeness."""
    nmap = gn.name_map(arch)
    files = ckpt.files
    params: list[tuple[str, tuple[int, ...]]] = []
    experts: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {}
    roles: dict[int, set[str]] = {}
    n_layer = cfg.num_hidden_layers
    per_expert = re.compile(r"(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
    for key in sorted(ckpt.keys):
        name = key.replace(".block_sparse_moe.", ".mlp.")
        m = per_expert.match(name)
        if m:
            proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}.get(m.group(4), m.group(4))
            experts.setdefault(m.group(1), {}).setdefault(proj, {})[int(m.group(3))] = files.shape(key)
            continue
        params.append((name, files.shape(key)))
    for base, projs in experts.items():
        shapes = [projs.get(p, {}) for p in ("gate_proj", "up_proj", "down_proj")]
        E = len(shapes[0])
        if any(sorted(sh) != list(range(E)) for sh in shapes) or len({sh[e] for sh in shapes[:2] for e in sh}) != 1:
            raise _LightUnsupported(f"{base}: incomplete or uneven experts")
        (I, H), down = shapes[0][0], set(shapes[2].values())
        if down != {(H, I)}:
            raise _LightUnsupported(f"{base}: down_proj shapes {down}")
        params += [(f"{base}.gate_up_proj", (E, 2 * I, H)), (f"{base}.down_proj", (E, H, I))]
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    top = set()
    for name, _ in params:
        base, leaf = name.rsplit(".", 1)
        if base.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
            g = ["ffn_gate_exps", "ffn_up_exps"] if leaf == "gate_up_proj" else ["ffn_down_exps"]
        else:
            gname = nmap.hf_to_gguf(name) if not (tied and name == "lm_head.weight") else "output.weight"
            if gname is None:
                raise _LightUnsupported(f"no GGUF name for '{name}'")
            if not gname.startswith("blk."):
                top.add(gname)
                continue
            g = [gname.split(".", 2)[2].removesuffix(".weight")]
        layer = int(re.match(r"model\.layers\.(\d+)\.", name).group(1))
        roles.setdefault(layer, set()).update(g)
    if set(roles) != set(range(n_layer)):
        raise _LightUnsupported(f"layers {sorted(roles)[:3]}... of {n_layer}")
    for layer, have in roles.items():
        if have != _light_roles(cfg, arch, layer):
            raise _LightUnsupported(f"layer {layer} holds {sorted(have)}")
    if not {"token_embd.weight", "output_norm.weight"} <= top or (not tied and "output.weight" not in top):
        raise _LightUnsupported(f"top-level tensors {sorted(top)}")
    return params


# ------------------------------------------------------------------------------ writing


#: tensors produced ahead of the one being written
_AHEAD = 2


def write_gguf(output: Path, metadata: dict, outs: list[_Out], log: Callable[[str], None] | None = None,
               progress: bool = False) -> None:
    """Stream ``outs`` into a GGUF file with gguf-py's writer (header, metadata, tensor infos, data)."""
    import gguf

    arch = metadata["general.architecture"][1]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch=arch)
    for k, (kind, v) in metadata.items():
        if k == "general.architecture":
            continue
        if kind == "arr":
            w.add_array(k, v)
            continue
        if kind in ("i32arr", "f32arr"):
            sub = gguf.GGUFValueType.INT32 if kind == "i32arr" else gguf.GGUFValueType.FLOAT32
            w.add_key_value(k, v, gguf.GGUFValueType.ARRAY, sub_type=sub)
            continue
        {"str": w.add_string, "u32": w.add_uint32, "f32": w.add_float32, "bool": w.add_bool}[kind](k, v)
    for o in outs:
        info = ggml_type_info(o.ggml_type)
        byte_shape = (*o.shape[:-1], info.row_bytes(o.shape[-1]))
        if info.name in ("F32", "F16"):
            w.add_tensor_info(o.name, o.shape, np.dtype(np.float32 if info.name == "F32" else np.float16), o.nbytes)
        else:
            w.add_tensor_info(o.name, byte_shape, np.dtype(np.uint8), o.nbytes,
                              raw_dtype=gguf.GGMLQuantizationType(info.id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(int(np.prod(o.shape)) for o in outs)
        bar = tqdm(total=total, unit="param", unit_scale=True, desc=f"quantizing {output.name}", file=sys.stderr)
    # tensors are read and quantized ahead on worker threads (the C++ quantizer releases the GIL)
    # while the main thread writes the previous one
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="convert")
    ahead = [pool.submit(o.produce) for o in outs[:_AHEAD]]
    for i, o in enumerate(outs):
        try:
            data = ahead[i].result()
        except BaseException:
            for f in ahead[i:]:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        ahead[i] = None  # drop the reference: memory stays near _AHEAD tensors
        if i + _AHEAD < len(outs):
            ahead.append(pool.submit(outs[i + _AHEAD].produce))
        if data.nbytes != o.nbytes:
            raise AssertionError(f"{o.name}: produced {data.nbytes} bytes, expected {o.nbytes}")
        w.write_tensor_data(data)
        if bar is not None:
            bar.update(int(np.prod(o.shape)))
            bar.set_postfix_str(f"{o.name} {o.ggml_type}", refresh=False)
        elif log:
            log(f"[{i + 1}/{len(outs)}] {o.name} {o.ggml_type} {list(o.shape)} ({time.time() - t0:.1f}s)")
    pool.shutdown()
    if bar is not None:
        bar.close()
    w.close()
    tmp.replace(output)


def convert(
    model_path: str | Path,
    output: str | Path,
    experts: str = "Q4_K",
    attention: str = "Q8_0",
    default: str = "Q6_K",
    embeddings: str | None = None,
    output_type: str | None = None,
    norms: str = "F32",
    log: Callable[[str], None] | None = None,
    preset: str | None = None,
    progress: bool = False,
    tokenizer: bool = True,
    light: bool = True,
) -> Path:
    """Convert an HF safetensors model folder into one GGUF file; returns the output path.

    ``preset`` (``Q4_K_M``, ``Q6_K``, ...) picks every tensor's type the way llama-quantize does
    for that preset and replaces the per-role types; ``tokenizer`` writes the folder's tokenizer.
    ``light``: convert the :data:`LIGHT_MODEL_TYPES` without importing torch or transformers when the
    folder allows it (the same file either way); False always goes through transformers.
    """
    mp = Path(model_path)
    if not (mp / "config.json").is_file():
        raise ConfigError(f"{mp}: no config.json (expected a Hugging Face model folder)")
    try:
        raw_cfg = json.loads((mp / "config.json").read_text(encoding="utf-8"))
        if not isinstance(raw_cfg, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{mp / 'config.json'}: not a valid JSON config ({e})") from e
    policy = None if preset else TypePolicy(experts, attention, default, embeddings, output_type, norms)
    planned = _plan_light(mp, raw_cfg, preset, policy) if light and raw_cfg.get("model_type") in LIGHT_MODEL_TYPES \
        else None
    if planned is None:
        config = _transformers_config(mp, raw_cfg)
        text_cfg = config.get_text_config() if config.model_type == "gemma3" else config
        if preset:
            policy = PresetPolicy.for_config(preset, text_cfg, _arch_of(config))
        arch, outs = plan(config, Checkpoint(mp), policy)
        md = metadata_for(text_cfg, arch, [o.name for o in outs])
    else:
        text_cfg, policy, arch, outs, md = planned
        if log:
            log("reading the folder without transformers (light path)")
    md["general.name"] = ("str", raw_cfg.get("_name_or_path") or mp.name)
    if preset:
        md["general.file_type"] = ("u32", FILE_TYPES[policy.preset])
    if tokenizer:
        from .weights.gguf_vocab import sentencepiece_metadata, tokenizer_metadata

        # like llama.cpp's converter: Llama and Gemma take a SentencePiece model before tokenizer.json
        first, second = ((sentencepiece_metadata, tokenizer_metadata) if arch in ("llama", "gemma3")
                         else (tokenizer_metadata, sentencepiece_metadata))
        vocab = first(mp, text_cfg.vocab_size, arch) or second(mp, text_cfg.vocab_size, arch)
        if vocab is not None:
            md.update(vocab)
        elif log:
            log(f"note: {mp} has neither a byte-level BPE tokenizer.json nor a SentencePiece tokenizer.model; "
                f"writing no vocabulary (no_vocab)")
    out = Path(output)
    write_gguf(out, md, outs, log, progress=progress)
    return out


def _transformers_config(mp: Path, raw_cfg: dict):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(mp))
    except Exception as e:
        raise ConfigError(f"{mp / 'config.json'}: cannot be read by transformers ({e})") from e
    if "scoring_func" in raw_cfg and not hasattr(config, "scoring_func"):
        config.scoring_func = raw_cfg["scoring_func"]
    return config


def _plan_light(mp: Path, raw_cfg: dict, preset: str | None, policy):
    """(config, policy, arch, outs, metadata) planned without transformers, or None where the light
    path cannot vouch for the folder (then transformers plans it)."""
    try:
        cfg = _ConfigView(raw_cfg)
        arch = _arch_of(cfg)
        ckpt = Checkpoint(mp, light=True)
        params = _checkpoint_params(cfg, ckpt, arch)
        if preset:
            policy = PresetPolicy.for_config(preset, cfg, arch)
        arch, outs = plan(cfg, ckpt, policy, params=params)
        md = metadata_for(cfg, arch, [o.name for o in outs])
    except _LightUnsupported:
        return None
    return cfg, policy, arch, outs, md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktransformers.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_path", "--model-path", required=True, help="Hugging Face model folder (safetensors)")
    ap.add_argument("--output", required=True, help="GGUF file to write")
    ap.add_argument("--experts", default="Q4_K", help="type of routed-expert tensors (default Q4_K)")
    ap.add_argument("--attention", default="Q8_0", help="type of attention projections (default Q8_0)")
    ap.add_argument("--default", default="Q6_K", help="type of other 2-D tensors (default Q6_K)")
    ap.add_argument("--embeddings", default=None, help="type of token_embd (default: --default)")
    ap.add_argument("--output-type", "--output_type", dest="output_type", default=None,
                    help="type of the output (lm_head) tensor (default: --default)")
    ap.add_argument("--norms", default="F32", help="type of 1-D tensors and routers (default F32)")
    ap.add_argument("--preset", default=None,
                    help=f"llama-quantize's type mix for a preset, replacing the per-role types ({', '.join(PRESETS)})")
    ap.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                    help="do not write the model folder's tokenizer into the file")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        out = convert(a.model_path, a.output, a.experts, a.attention, a.default, a.embeddings, a.output_type,
                      a.norms, log=None if a.quiet else (lambda s: print(s, file=sys.stderr)), preset=a.preset,
                      progress=not a.quiet, tokenizer=a.tokenizer)
    except KTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
