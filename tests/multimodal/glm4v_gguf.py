"""The tiny GLM-4.5V (``glm4v_moe``) as llama.cpp writes it: a language-model GGUF (``glm4moe`` with
``rope.dimension_sections``) and an ``mmproj`` GGUF (``clip``, projector ``glm4v``), with gguf-py,
following llama.cpp's converter (``conversion/glm.py``: ``Glm4MoeModel``; ``conversion/qwen3vl.py``:
``Glm4VVisionModel``; names from ``gguf-py/gguf/tensor_mapping.py``) rather than this project's reader.
Where llama.cpp's sources are at hand the test compares these files with the converter's own output."""

from __future__ import annotations

from pathlib import Path

import torch

from gguf_files import add_text_model_keys, finish

from .vl_gguf import _add, add_vocab_and_ends, mmproj_writer

_ATTN = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "post_attention_layernorm": "post_attention_norm"}


def _state(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update({k: v for k, v in load_file(f).items() if k.startswith(prefix)})
    return sd


def write_glm4v_lm_gguf(folder: Path, out: Path, sections: bool = True) -> Path:
    """The language model as ``Glm4MoeModel`` writes GLM-4.5V's (F32, the tiny tokenizer's vocabulary
    and chat template); ``sections=False``: without the M-RoPE sections, as a text-only GLM-4.5 file."""
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    tc = cfg.text_config
    sd = _state(folder)
    A = "glm4moe"
    w = gguf.GGUFWriter(str(out), arch=A)
    w.add_name("tiny-glm4v-moe")
    add_text_model_keys(w, tc)
    rope = tc.rope_parameters
    if sections:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(tc.rms_norm_eps)
    w.add_expert_count(tc.n_routed_experts)
    w.add_expert_used_count(tc.num_experts_per_tok)
    w.add_expert_group_count(tc.n_group)
    w.add_expert_group_used_count(tc.topk_group)
    w.add_key_length(tc.head_dim)
    w.add_value_length(tc.head_dim)
    w.add_rope_dimension_count(int(tc.head_dim * rope.get("partial_rotary_factor", 0.5)))
    w.add_expert_feed_forward_length(tc.moe_intermediate_size)
    w.add_expert_shared_count(tc.n_shared_experts)
    w.add_leading_dense_block_count(tc.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(tc.routed_scaling_factor)
    w.add_expert_weights_norm(tc.norm_topk_prob)
    L = add_vocab_and_ends(w, folder, tc.vocab_size, "glm4", sd)
    for i in range(tc.num_hidden_layers):
        p = f"{L}layers.{i}."
        for hf, g in _ATTN.items():
            for s in ("weight", "bias"):
                if f"{p}{hf}.{s}" in sd:
                    _add(w, f"blk.{i}.{g}.{s}", sd[f"{p}{hf}.{s}"])
        if i < tc.first_k_dense_replace:
            for x in ("gate", "up", "down"):
                _add(w, f"blk.{i}.ffn_{x}.weight", sd[f"{p}mlp.{x}_proj.weight"])
            continue
        _add(w, f"blk.{i}.ffn_gate_inp.weight", sd[f"{p}mlp.gate.weight"])
        _add(w, f"blk.{i}.exp_probs_b.bias", sd[f"{p}mlp.gate.e_score_correction_bias"])
        for x in ("gate", "up", "down"):
            stacked = torch.stack([sd[f"{p}mlp.experts.{e}.{x}_proj.weight"] for e in range(tc.n_routed_experts)])
            _add(w, f"blk.{i}.ffn_{x}_exps.weight", stacked)
            _add(w, f"blk.{i}.ffn_{x}_shexp.weight", sd[f"{p}mlp.shared_experts.{x}_proj.weight"])
    return finish(w, out)


def write_glm4v_mmproj(folder: Path, out: Path, qtype: str = "f32", meta: dict | None = None,
                       drop: tuple[str, ...] = ()) -> Path:
    """The vision tower as ``Glm4VVisionModel`` writes it (``qtype`` f32 / f16 for the matrices; the
    patch embedding F16 or F32 and the vectors and position embedding F32, as the converter keeps
    them); ``meta`` replaces (None: removes) metadata keys, ``drop`` leaves tensors out.  The tiny
    processor's pixel bounds are added, which the converter does not write."""
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    vc = cfg.vision_config
    keys: dict = {
        "clip.has_vision_encoder": ("bool", True),
        "clip.vision.projection_dim": ("u32", cfg.text_config.hidden_size),
        "clip.vision.image_size": ("u32", vc.image_size),
        "clip.vision.patch_size": ("u32", vc.patch_size),
        "clip.vision.embedding_length": ("u32", vc.hidden_size),
        "clip.vision.feed_forward_length": ("u32", vc.intermediate_size),
        "clip.vision.block_count": ("u32", vc.depth),
        "clip.vision.attention.head_count": ("u32", vc.num_heads),
        "clip.vision.image_mean": ("f32arr", [0.5, 0.5, 0.5]),
        "clip.vision.image_std": ("f32arr", [0.5, 0.5, 0.5]),
        "clip.projector_type": ("str", "glm4v"),
        "clip.use_silu": ("bool", True),
        "clip.vision.attention.layer_norm_epsilon": ("f32", vc.rms_norm_eps),
        # the tiny processor's bounds (tiny_models), which the converter does not write
        "clip.vision.image_min_pixels": ("u32", 1024),
        "clip.vision.image_max_pixels": ("u32", 16384),
    }
    w = mmproj_writer(out, keys, meta, qtype)
    V = "model.visual."
    sd = _state(folder, V)
    pe = sd[V + "patch_embed.proj.weight"]  # [C, 3, 2, p, p]: split along time
    pe_type = "f16" if qtype == "f16" else "f32"
    tensors = [("v.patch_embd.weight", pe[:, :, 0], pe_type), ("v.patch_embd.weight.1", pe[:, :, 1], pe_type),
               ("v.patch_embd.bias", sd[V + "patch_embed.proj.bias"], "f32"),
               ("v.norm_embd.weight", sd[V + "post_conv_layernorm.weight"], "f32"),
               ("v.position_embd.weight", sd[V + "embeddings.position_embedding.weight"], "f32"),
               ("v.post_ln.weight", sd[V + "post_layernorm.weight"], "f32"),
               ("mm.patch_merger.weight", sd[V + "downsample.weight"], qtype),
               ("mm.patch_merger.bias", sd[V + "downsample.bias"], "f32"),
               ("mm.model.fc.weight", sd[V + "merger.proj.weight"], qtype),
               ("mm.post_norm.weight", sd[V + "merger.post_projection_norm.weight"], "f32"),
               ("mm.post_norm.bias", sd[V + "merger.post_projection_norm.bias"], "f32")]
    for x in ("gate", "up", "down"):
        tensors.append((f"mm.{x}.weight", sd[f"{V}merger.{x}_proj.weight"], qtype))
    leaves = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for n in range(vc.depth):
        for hf, g in leaves.items():
            for s in ("weight", "bias"):
                t = sd.get(f"{V}blocks.{n}.{hf}.{s}")
                if t is not None:
                    tensors.append((f"v.blk.{n}.{g}.{s}", t, qtype if t.ndim > 1 else "f32"))
    for name, t, q in tensors:
        if name not in drop:
            _add(w, name, t, q)
    return finish(w, out)
