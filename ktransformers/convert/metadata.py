"""llama.cpp's GGUF metadata keys for a model config."""

from __future__ import annotations

from typing import Iterable

from ..weights import gguf_names as gn


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
    # the MTP block, as llama.cpp counts it: one more block, with its entry in the per-layer keys
    names, n = set(tensor_names), c.num_hidden_layers
    mtp = f"blk.{n}.nextn.eh_proj.weight" in names
    if A in gn.DSA_ARCHS:
        from ..generation.mtp import has_own_indexer, mtp_config

        own = has_own_indexer([gn.name_map(A).gguf_to_hf(t) or "" for t in names], n)
        md.update(gn.dsa_metadata(mtp_config(c, own) if mtp else c, A))
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
    if mtp:
        md[f"{A}.block_count"] = ("u32", c.num_hidden_layers + 1)
        md[f"{A}.nextn_predict_layers"] = ("u32", 1)
    return md
