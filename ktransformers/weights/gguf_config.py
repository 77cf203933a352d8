"""transformers configs (and tokenizers) from GGUF metadata.

:func:`config_from_metadata` turns llama.cpp's ``<arch>.*`` keys into the transformers 5.24 config
class the unmodified HF model is built from:

=============  ==========================================================================
GGUF arch      config
=============  ==========================================================================
llama          LlamaConfig, or MixtralConfig when ``llama.expert_count`` > 0
qwen2 / qwen3  Qwen2Config / Qwen3Config
qwen2moe       Qwen2MoeConfig
qwen3moe       Qwen3MoeConfig
qwen3vlmoe     Qwen3MoeConfig: Qwen3-VL-MoE's language model alone (text positions are equal on the
               three M-RoPE axes, so plain RoPE gives the same result); with the vision tower of an
               ``mmproj`` file, ``weights.mmproj`` builds the Qwen3VLMoeConfig
deepseek2      DeepseekV3Config when ``expert_gating_func`` is 2 (sigmoid) or the file has
               ``exp_probs_b`` tensors, else DeepseekV2Config (``block_count - nextn_predict_layers``
               layers where the file keeps the MTP block)
deepseek32     DeepseekV32Config (the deepseek2 keys plus ``attention.indexer.*``; ``expert_gating_func``
               sigmoid or absent, its only router; the MTP block as deepseek2's)
glm-dsa        GlmMoeDsaConfig (as deepseek32; ``attention.indexer.types``: true where a layer runs
               its own indexer, false where it reuses the previous top-k; the MTP block as
               deepseek2's, its entry in the indexer types dropped with it)
gemma3         Gemma3TextConfig
glm4moe        Glm4MoeConfig (``block_count`` counts the NextN/MTP layers llama.cpp keeps; the
               model has ``block_count - nextn_predict_layers``)
minimax-m2     MiniMaxM2Config
gpt-oss        GptOssConfig (sliding / full layers alternate from layer 0; yarn without truncation)
deepseek4      DeepseekV4Config (``attention.compress_ratios`` per layer: 0 sliding, otherwise
               compressed-sparse where the layer has indexer tensors, heavily-compressed where
               not; layers with an ``ffn_gate_tid2eid`` table are ``hash_moe``; one swiglu clamp)
qwen3next      Qwen3NextConfig (``attention.recurrent_layers`` or ``full_attention_interval`` give
               the layer types, ``ssm.*`` the DeltaNet sizes; layers without a router are
               ``mlp_only_layers``; ``block_count`` counts the MTP layers llama.cpp keeps)
qwen35moe      Qwen3_5MoeTextConfig (as qwen3next, every layer sparse; ``rope.dimension_sections``
               the MRoPE sections, kept in ``rope_parameters`` where not transformers' default)
=============  ==========================================================================

Conventions: the config says ``dtype=float32`` (override with ``dtype=``), and
``tie_word_embeddings`` is true exactly when the file has no ``output.weight``.  deepseek2 files
written by recent llama.cpp describe MLA as MQA (``head_count_kv = 1``, ``key_length =
kv_lora_rank + rope``); the real per-head sizes are ``key_length_mla`` / ``value_length_mla``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import WeightError
from .gguf_names import SUPPORTED_ARCHS

# llama.cpp's gemma3 constants (not stored in the file): local (sliding) rope base and SWA pattern
GEMMA3_ROPE_LOCAL_BASE = 10000.0
GEMMA3_SLIDING_PATTERN = 6


class _Meta:
    def __init__(self, meta: Mapping[str, Any], arch: str, where: str):
        self.m = meta
        self.arch = arch
        self.where = where

    def get(self, key: str, default=None):
        v = self.m.get(f"{self.arch}.{key}", default)
        if isinstance(v, list) and v and not isinstance(v[0], str):
            # per-layer arrays (e.g. feed_forward_length on some files): use the largest value
            v = max(v)
        return v

    def need(self, key: str):
        v = self.get(key)
        if v is None:
            raise WeightError(f"{self.where}: GGUF metadata lacks '{self.arch}.{key}'")
        return v


def _rope_parameters(md: _Meta, theta: float) -> dict:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(theta)}
    kind = md.get("rope.scaling.type")
    factor = md.get("rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return rope
    if kind == "linear":
        rope.update(rope_type="linear", factor=float(factor))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=float(factor))
        orig = md.get("rope.scaling.original_context_length")
        if orig:
            rope["original_max_position_embeddings"] = int(orig)
        logm = md.get("rope.scaling.yarn_log_multiplier")
        if logm:
            # llama.cpp's converter writes 0.1 * mscale_all_dim
            rope["mscale_all_dim"] = float(logm) / 0.1
            rope["mscale"] = rope["mscale_all_dim"]
        for k_g, k_h in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            v = md.get(k_g)
            if v:
                rope[k_h] = float(v)
    else:
        rope.update(rope_type=str(kind), factor=float(factor))
    return rope


def config_from_metadata(
    meta: Mapping[str, Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    where: str = "gguf",
    dtype: torch.dtype | str = torch.float32,
):
    """Build the transformers config for a GGUF file from its metadata and tensor shapes.

    ``tensor_shapes`` maps GGUF tensor names to torch-order shapes (used for the vocabulary size,
    tied embeddings and a few sizes that older files do not store).
    """
    import transformers as tf

    arch = meta.get("general.architecture")
    if arch is None:
        raise WeightError(f"{where}: GGUF metadata lacks 'general.architecture'")
    if arch not in SUPPORTED_ARCHS:
        raise WeightError(
            f"{where}: GGUF architecture '{arch}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)}; llama includes mixtral-style MoE)"
        )
    md = _Meta(meta, arch, where)

    emb = tensor_shapes.get("token_embd.weight")
    vocab = md.get("vocab_size")
    if emb is not None:
        vocab = int(emb[0])
    elif vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else None
    if vocab is None:
        raise WeightError(f"{where}: cannot tell the vocabulary size (no token_embd.weight, no {arch}.vocab_size)")

    hidden = int(md.need("embedding_length"))
    n_layers = int(md.need("block_count"))
    n_head = int(md.need("attention.head_count"))
    n_head_kv = int(md.get("attention.head_count_kv", n_head))
    kw: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=n_head_kv,
        max_position_embeddings=int(md.get("context_length", 4096)),
        rms_norm_eps=float(md.get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
    )
    ffn = md.get("feed_forward_length")
    if ffn is not None:
        kw["intermediate_size"] = int(ffn)
    for key, attr in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if meta.get(key) is not None:
            kw[attr] = int(meta[key])
    theta = float(md.get("rope.freq_base", 10000.0))
    key_len = md.get("attention.key_length")
    n_expert = int(md.get("expert_count", 0) or 0)

    def expert_ffn():
        v = md.get("expert_feed_forward_length")
        if v is None:
            shp = tensor_shapes.get("blk.0.ffn_gate_exps.weight") or tensor_shapes.get(
                f"blk.{n_layers - 1}.ffn_gate_exps.weight"
            )
            if shp is None:
                raise WeightError(f"{where}: GGUF metadata lacks '{arch}.expert_feed_forward_length'")
            v = shp[1]
        return int(v)

    if arch == "llama":
        head_dim = int(key_len or md.get("rope.dimension_count") or hidden // n_head)
        kw.update(head_dim=head_dim, rope_parameters=_rope_parameters(md, theta))
        kw["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
        if n_expert:
            kw.pop("attention_bias")
            kw.update(
                num_local_experts=n_expert,
                num_experts_per_tok=int(md.need("expert_used_count")),
                intermediate_size=int(md.get("expert_feed_forward_length") or ffn),
                sliding_window=None,
            )
            cfg = tf.MixtralConfig(**kw)
        else:
            cfg = tf.LlamaConfig(**kw)
    elif arch in ("qwen2", "qwen3"):
        kw["rope_parameters"] = _rope_parameters(md, theta)
        if arch == "qwen3":
            kw["head_dim"] = int(key_len or hidden // n_head)
            kw["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
            cfg = tf.Qwen3Config(**kw)
        else:
            cfg = tf.Qwen2Config(**kw)
    elif arch in ("qwen2moe", "qwen3moe", "qwen3vlmoe"):
        kw.update(
            rope_parameters=_rope_parameters(md, theta),
            num_experts=n_expert,
            num_experts_per_tok=int(md.need("expert_used_count")),
            moe_intermediate_size=expert_ffn(),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if arch == "qwen2moe":
            sh = md.get("expert_shared_feed_forward_length")
            if sh is None:
                shp = tensor_shapes.get("blk.0.ffn_gate_shexp.weight")
                sh = shp[0] if shp is not None else kw.get("intermediate_size", 0)
            kw.update(shared_expert_intermediate_size=int(sh), norm_topk_prob=False)
            cfg = tf.Qwen2MoeConfig(**kw)
        else:
            kw.update(head_dim=int(key_len or hidden // n_head), norm_topk_prob=True)
            kw["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
            cfg = tf.Qwen3MoeConfig(**kw)
    elif arch in ("deepseek2", "deepseek32", "glm-dsa"):
        # a file that keeps the MTP block counts it in block_count (and in glm-dsa's indexer types)
        n_layers = kw["num_hidden_layers"] = n_layers - int(md.get("nextn_predict_layers", 0) or 0)
        rope_dim = int(md.need("rope.dimension_count"))
        k_mla = md.get("attention.key_length_mla")
        v_mla = md.get("attention.value_length_mla")
        k_len = int(k_mla if k_mla is not None else md.need("attention.key_length"))
        v_len = int(v_mla if v_mla is not None else md.need("attention.value_length"))
        q_lora = md.get("attention.q_lora_rank")
        gating = int(md.get("expert_gating_func", 1) or 1)
        has_bias = any(n.endswith("exp_probs_b.bias") for n in tensor_shapes)
        n_group = int(md.get("expert_group_count", 1) or 1)
        topk_group = int(md.get("expert_group_used_count", 1) or 1)
        kw.update(
            num_key_value_heads=n_head,  # MLA: llama.cpp's head_count_kv=1 is its MQA view
            rope_parameters=_rope_parameters(md, theta),
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(md.need("attention.kv_lora_rank")),
            qk_rope_head_dim=rope_dim,
            qk_nope_head_dim=k_len - rope_dim,
            v_head_dim=v_len,
            head_dim=rope_dim,
            first_k_dense_replace=int(md.get("leading_dense_block_count", 0) or 0),
            n_routed_experts=n_expert,
            num_experts_per_tok=int(md.need("expert_used_count")),
            moe_intermediate_size=expert_ffn(),
            n_shared_experts=int(md.get("expert_shared_count", 0) or 0),
            routed_scaling_factor=float(md.get("expert_weights_scale", 1.0) or 1.0),
            norm_topk_prob=bool(md.get("expert_weights_norm", False)),
            n_group=n_group,
            topk_group=topk_group,
        )
        if arch in ("deepseek32", "glm-dsa"):
            # absent: sigmoid, as llama.cpp's glm-dsa loader takes it
            if (func := md.get("expert_gating_func")) not in (None, 2):
                raise WeightError(f"{md.where}: '{arch}.expert_gating_func' is {func}; DeepSeek-V3.2 and "
                                  "GLM-5 route with sigmoid (2)")
            kw.update(index_n_heads=int(md.need("attention.indexer.head_count")),
                      index_head_dim=int(md.need("attention.indexer.key_length")),
                      index_topk=int(md.need("attention.indexer.top_k")))
            if arch == "deepseek32":
                cfg = tf.DeepseekV32Config(**kw)
            else:
                types = md.m.get(f"{arch}.attention.indexer.types")  # per layer: not collapsed by get()
                if types is not None:
                    kw["indexer_types"] = ["full" if t else "shared" for t in types][:n_layers]
                cfg = tf.GlmMoeDsaConfig(**kw)
        elif gating == 2 or has_bias:
            kw.update(num_nextn_predict_layers=0, rope_interleave=True)
            cfg = tf.DeepseekV3Config(**kw)
        else:
            kw["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
            cfg = tf.DeepseekV2Config(**kw)
    elif arch == "glm4moe":
        cfg = _glm4moe_config(md, kw, tensor_shapes, expert_ffn)
    elif arch == "minimax-m2":
        cfg = _minimax_m2_config(md, kw, expert_ffn)
    elif arch == "gpt-oss":
        cfg = _gpt_oss_config(md, kw, tensor_shapes, expert_ffn)
    elif arch in ("qwen3next", "qwen35moe"):
        cfg = _linear_attn_config(md, kw, tensor_shapes, expert_ffn)
    elif arch == "deepseek4":
        cfg = _deepseek4_config(md, kw, tensor_shapes, expert_ffn)
    elif arch == "gemma3":
        head_dim = int(key_len or 256)
        # llama.cpp scales queries by 1/sqrt(head_dim), except 27B (62 layers): 1/sqrt(hidden/heads)
        qpas = hidden // n_head if n_layers == 62 else head_dim
        full = _rope_parameters(md, theta)
        kw.update(
            head_dim=head_dim,
            sliding_window=int(md.get("attention.sliding_window", 4096)),
            query_pre_attn_scalar=qpas,
            rope_parameters={
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_ROPE_LOCAL_BASE},
            },
            layer_types=[
                "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                for i in range(n_layers)
            ],
            final_logit_softcapping=md.get("final_logit_softcapping"),
            attn_logit_softcapping=md.get("attn_logit_softcapping"),
        )
        cfg = tf.Gemma3TextConfig(**kw)
    else:
        raise WeightError(
            f"{where}: GGUF architecture '{arch}' is not supported "
            "(supported: llama, mixtral-style llama, qwen2, qwen3, qwen2moe, qwen3moe, qwen3vlmoe, deepseek2, deepseek32, glm-dsa, gemma3, glm4moe, minimax-m2, "
            "gpt-oss, qwen3next, qwen35moe, deepseek4)"
        )
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    cfg.dtype = dtype
    name = meta.get("general.name")
    if name:
        cfg._name_or_path = str(name)
    cfg.architectures = [_ARCH_CLASS[type(cfg).__name__]]
    return cfg


_ARCH_CLASS = {
    "LlamaConfig": "LlamaForCausalLM",
    "MixtralConfig": "MixtralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "Qwen2MoeConfig": "Qwen2MoeForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
    "DeepseekV2Config": "DeepseekV2ForCausalLM",
    "DeepseekV3Config": "DeepseekV3ForCausalLM",
    "DeepseekV32Config": "DeepseekV32ForCausalLM",
    "GlmMoeDsaConfig": "GlmMoeDsaForCausalLM",
    "Gemma3TextConfig": "Gemma3ForCausalLM",
    "Glm4MoeConfig": "Glm4MoeForCausalLM",
    "MiniMaxM2Config": "MiniMaxM2ForCausalLM",
    "GptOssConfig": "GptOssForCausalLM",
    "Qwen3NextConfig": "Qwen3NextForCausalLM",
    "Qwen3_5MoeTextConfig": "Qwen3_5MoeForCausalLM",
    "DeepseekV4Config": "DeepseekV4ForCausalLM",
}


def _deepseek4_config(md: _Meta, kw: dict, tensor_shapes, expert_ffn):
    """DeepseekV4Config: attention kind per layer from the compress ratios and the tensors,
    hyper-connections, hash-routed layers, sqrt-softplus routing (the only one llama.cpp loads)."""
    import transformers as tf

    n_layers = kw["num_hidden_layers"]
    where, A = md.where, md.arch
    if (func := md.get("expert_gating_func")) not in (None, 4):
        raise WeightError(f"{where}: '{A}.expert_gating_func' is {func}; DeepSeek-V4 routes with sqrtsoftplus (4)")
    ratios = md.m.get(f"{A}.attention.compress_ratios")  # per layer: not collapsed by get()
    if ratios is None or len(ratios) < n_layers:
        raise WeightError(f"{where}: '{A}.attention.compress_ratios' needs an entry for each of {n_layers} layers")
    layer_types, rates = [], {}
    for i, r in enumerate(int(x) for x in ratios[:n_layers]):
        if r == 0:
            layer_types.append("sliding_attention")
            continue
        kind = ("compressed_sparse_attention" if f"blk.{i}.indexer.attn_q_b.weight" in tensor_shapes
                else "heavily_compressed_attention")
        if rates.setdefault(kind, r) != r:
            raise WeightError(f"{where}: '{A}.attention.compress_ratios' gives {kind} layers ratios "
                              f"{rates[kind]} and {r}; the config holds one per kind")
        layer_types.append(kind)
    hashed = [f"blk.{i}.ffn_gate_tid2eid.weight" in tensor_shapes for i in range(n_layers)]
    n_hash = int(md.get("hash_layer_count", 0) or 0)
    if hashed != [i < n_hash for i in range(n_layers)]:
        raise WeightError(f"{where}: '{A}.hash_layer_count' is {n_hash} but the layers with an ffn_gate_tid2eid "
                          f"table are {[i for i, h in enumerate(hashed) if h]}")
    clamps = set()
    for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        v = md.m.get(f"{A}.{key}")
        if v is not None:
            clamps.update(float(x) for x in (v if isinstance(v, (list, tuple)) else [v])[:n_layers])
    if len(clamps) > 1:
        raise WeightError(f"{where}: '{A}.swiglu_clamp_exp' / '_shexp' hold several values {sorted(clamps)}; "
                          "the config has one swiglu_limit")
    head_dim = int(md.need("attention.key_length"))
    rope = _rope_parameters(md, float(md.get("rope.freq_base", 10000.0)))
    kw.update(
        head_dim=head_dim,
        rope_theta=rope.pop("rope_theta"),
        rope_parameters=rope if rope["rope_type"] != "default" else None,
        partial_rotary_factor=int(md.need("rope.dimension_count")) / head_dim,
        compress_rope_theta=float(md.need("attention.compress_rope_freq_base")),
        q_lora_rank=int(md.need("attention.q_lora_rank")),
        o_lora_rank=int(md.need("attention.output_lora_rank")),
        o_groups=int(md.need("attention.output_group_count")),
        sliding_window=int(md.need("attention.sliding_window")),
        layer_types=layer_types,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **rates},
        mlp_layer_types=["hash_moe" if h else "moe" for h in hashed],
        index_n_heads=int(md.need("attention.indexer.head_count")),
        index_head_dim=int(md.need("attention.indexer.key_length")),
        index_topk=int(md.need("attention.indexer.top_k")),
        hc_mult=int(md.need("hyper_connection.count")),
        hc_sinkhorn_iters=int(md.need("hyper_connection.sinkhorn_iterations")),
        hc_eps=float(md.need("hyper_connection.epsilon")),
        n_routed_experts=int(md.need("expert_count")),
        num_experts_per_tok=int(md.need("expert_used_count")),
        moe_intermediate_size=expert_ffn(),
        n_shared_experts=int(md.get("expert_shared_count", 1) or 1),
        routed_scaling_factor=float(md.get("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(md.get("expert_weights_norm", True)),
        scoring_func="sqrtsoftplus",
        num_nextn_predict_layers=0,  # llama.cpp keeps the MTP block in a file of its own
    )
    if clamps:
        kw["swiglu_limit"] = clamps.pop()
    return tf.DeepseekV4Config(**kw)


def _linear_attn_config(md: _Meta, kw: dict, tensor_shapes, expert_ffn):
    """Qwen3NextConfig / Qwen3_5MoeTextConfig: gated DeltaNet (``ssm.*``: conv kernel, key head size,
    key / value head counts, value width) and gated full attention with partial rotary, softmax
    top-k with normalised weights, a gated shared expert."""
    import transformers as tf

    from .gguf_names import QWEN35_MROPE_SECTIONS

    n_layers = kw["num_hidden_layers"] - int(md.get("nextn_predict_layers", 0) or 0)
    head_dim = int(md.get("attention.key_length") or kw["hidden_size"] // kw["num_attention_heads"])
    rope = _rope_parameters(md, float(md.get("rope.freq_base", 10000.0)))
    rope["partial_rotary_factor"] = int(md.get("rope.dimension_count") or head_dim // 4) / head_dim
    recurrent = md.m.get(f"{md.arch}.attention.recurrent_layers")  # per layer: not collapsed by get()
    if recurrent is not None:
        if len(recurrent) < n_layers:
            raise WeightError(f"{md.where}: '{md.arch}.attention.recurrent_layers' has {len(recurrent)} entries "
                              f"for {n_layers} layers")
        layer_types = ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]]
    else:
        interval = int(md.get("full_attention_interval", 4) or 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    n_v = int(md.need("ssm.time_step_rank"))
    if n_v <= 0:
        raise WeightError(f"{md.where}: '{md.arch}.ssm.time_step_rank' is {n_v}; the DeltaNet needs value heads")
    kw.update(
        num_hidden_layers=n_layers,
        head_dim=head_dim,
        rope_parameters=rope,
        partial_rotary_factor=rope["partial_rotary_factor"],
        layer_types=layer_types,
        linear_conv_kernel_dim=int(md.need("ssm.conv_kernel")),
        linear_key_head_dim=int(md.need("ssm.state_size")),
        linear_num_key_heads=int(md.need("ssm.group_count")),
        linear_num_value_heads=n_v,
        linear_value_head_dim=int(md.need("ssm.inner_size")) // n_v,
        num_experts=int(md.need("expert_count")),
        num_experts_per_tok=int(md.need("expert_used_count")),
        moe_intermediate_size=expert_ffn(),
        shared_expert_intermediate_size=int(md.need("expert_shared_feed_forward_length")),
    )
    if md.arch == "qwen35moe":
        sections = md.m.get(f"{md.arch}.rope.dimension_sections")  # a list: not collapsed by get()
        if sections is not None and list(sections[:3]) != QWEN35_MROPE_SECTIONS[:3]:
            if len(sections) < 3:
                raise WeightError(f"{md.where}: '{md.arch}.rope.dimension_sections' has {len(sections)} entries; "
                                  "MRoPE needs 3 (time, height, width)")
            rope["mrope_section"] = [int(x) for x in sections[:3]]
        no_router = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes]
        if no_router:
            raise WeightError(f"{md.where}: layer {no_router[0]} has no 'blk.{no_router[0]}.ffn_gate_inp.weight'; "
                              "every Qwen3.5-MoE layer is sparse")
        kw.pop("intermediate_size", None)
        return tf.Qwen3_5MoeTextConfig(**kw)
    kw.update(norm_topk_prob=True, decoder_sparse_step=1,
              mlp_only_layers=[i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes])
    return tf.Qwen3NextConfig(**kw)


def _gpt_oss_config(md: _Meta, kw: dict, tensor_shapes, expert_ffn):
    """GptOssConfig: every layer sparse (``expert_feed_forward_length`` is the config's
    ``intermediate_size``), sliding-window layers alternating with full ones, attention sinks and
    biases.  The released models use yarn with ``truncate: false``, which the file does not store."""
    import transformers as tf

    head_dim = int(md.get("attention.key_length") or kw["hidden_size"] // kw["num_attention_heads"])
    rope = _rope_parameters(md, float(md.get("rope.freq_base", 150000.0)))
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    for tok in ("bos_token_id", "eos_token_id"):
        kw.setdefault(tok, None)
    kw.update(
        head_dim=head_dim,
        rope_parameters=rope,
        sliding_window=int(md.get("attention.sliding_window", 128)),
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        num_local_experts=int(md.need("expert_count")),
        num_experts_per_tok=int(md.need("expert_used_count")),
        intermediate_size=expert_ffn(),
    )
    return tf.GptOssConfig(**kw)


def _minimax_m2_config(md: _Meta, kw: dict, expert_ffn):
    """MiniMaxM2Config: every layer sparse (``expert_feed_forward_length`` is the config's
    ``intermediate_size``), sigmoid router, partial rotary of ``rope.dimension_count``."""
    import transformers as tf

    head_dim = int(md.get("attention.key_length") or kw["hidden_size"] // kw["num_attention_heads"])
    rope = _rope_parameters(md, float(md.get("rope.freq_base", 10000.0)))
    rope["partial_rotary_factor"] = int(md.get("rope.dimension_count") or head_dim) / head_dim
    for tok in ("bos_token_id", "eos_token_id"):
        kw.setdefault(tok, None)  # not the released model's ids when the file does not say
    kw.update(
        head_dim=head_dim,
        rope_parameters=rope,
        num_local_experts=int(md.need("expert_count")),
        num_experts_per_tok=int(md.need("expert_used_count")),
        intermediate_size=expert_ffn(),
    )
    return tf.MiniMaxM2Config(**kw)


def _glm4moe_config(md: _Meta, kw: dict, tensor_shapes, expert_ffn):
    """Glm4MoeConfig: GQA with partial rotary (``rope.dimension_count`` of ``key_length``), sigmoid
    router with correction bias, ``leading_dense_block_count`` dense layers, shared experts."""
    import transformers as tf

    n_layers = kw["num_hidden_layers"] - int(md.get("nextn_predict_layers", 0) or 0)
    head_dim = int(md.get("attention.key_length") or kw["hidden_size"] // kw["num_attention_heads"])
    rope_dim = int(md.get("rope.dimension_count") or head_dim // 2)
    rope = _rope_parameters(md, float(md.get("rope.freq_base", 10000.0)))
    rope["partial_rotary_factor"] = rope_dim / head_dim
    kw.update(
        num_hidden_layers=n_layers,
        head_dim=head_dim,
        rope_parameters=rope,
        partial_rotary_factor=rope_dim / head_dim,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        use_qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        n_routed_experts=int(md.need("expert_count")),
        num_experts_per_tok=int(md.need("expert_used_count")),
        moe_intermediate_size=expert_ffn(),
        n_shared_experts=int(md.get("expert_shared_count", 1) or 0),
        first_k_dense_replace=int(md.get("leading_dense_block_count", 0) or 0),
        routed_scaling_factor=float(md.get("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(md.get("expert_weights_norm", True)),
        n_group=int(md.get("expert_group_count", 1) or 1),
        topk_group=int(md.get("expert_group_used_count", 1) or 1),
    )
    return tf.Glm4MoeConfig(**kw)


def tokenizer_from_gguf(path, meta: Mapping[str, Any]):
    """A transformers tokenizer from the file's ``tokenizer.ggml.*`` metadata, or None for
    ``no_vocab`` files (built once, then cached: see :mod:`.gguf_tokenizer`)."""
    from .gguf_tokenizer import tokenizer_from_gguf as build

    return build(path, meta)
