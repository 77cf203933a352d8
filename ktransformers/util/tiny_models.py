"""Tiny random models of every supported architecture, written to disk like real checkpoints.

Used by the tests, the examples and anyone writing rules for a family without downloading
a real model: ``write_tiny_model("qwen3_moe", "/tmp/tiny")`` leaves ``config.json``,
``model.safetensors`` (per-expert keys, as ``save_pretrained`` writes them), a byte-level
tokenizer with a ChatML chat template, and ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# small but structurally complete configs (every branch of each architecture is present)
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)

TINY_CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      intermediate_size=96, norm_topk_prob=True),
    "qwen2_moe": dict(_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, intermediate_size=96),
    "mixtral": dict(_COMMON, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "deepseek_v3": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True),
    "deepseek_v2": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                        n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                        topk_method="greedy", routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    # GLM-4.5 / 4.6 / 4.7: dense first layer, one shared expert, sigmoid router with correction bias,
    # GQA with partial rotary (half of head_dim), attention biases, per-head q/k norms
    "glm4_moe": dict(_COMMON, num_hidden_layers=3, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     attention_bias=True, use_qk_norm=True),
    # Qwen3.5-MoE, text part: a gated-DeltaNet linear-attention layer and a gated full-attention layer
    # (partial rotary; the real models repeat 3 linear + 1 full); every layer sparse with a gated shared
    # expert.  Two layers, not four: the random DeltaNet layers amplify bf16 rounding ~2.5x each.
    "qwen3_5_moe_text": dict(_COMMON, layer_types=["linear_attention", "full_attention"], head_dim=16, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4),
    # Qwen3-Next: as Qwen3.5-MoE (gated DeltaNet + gated full attention, gated shared expert) with the
    # DeltaNet projections fused (in_proj_qkvz, in_proj_ba); the DeltaNet layer keeps a dense MLP
    # (mlp_only_layers) so that branch is present.  One DeltaNet layer: random ones amplify bf16 rounding.
    "qwen3_next": dict(_COMMON, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "full_attention"],
                       mlp_only_layers=[0], head_dim=16, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4),
    # DeepSeek-V3.2: DeepSeek-V3's MLA, router and experts plus the sparse-attention indexer (its own
    # query/key projections, a top-k of 4 keys per query: fewer than the test prompts, so it selects).
    # 16 indexer heads: with few, every head's ReLU score is often 0 for a key, and such exact ties at the
    # top-k boundary go either way with the key buffer's length (static vs dynamic cache)
    "deepseek_v32": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                         routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=4,
                         index_head_dim=16, index_n_heads=16),
    # GLM-5: as DeepSeek-V3.2 with an interleaved-rotary indexer; the last layer reuses the previous
    # layer's top-k ("shared") instead of running its own indexer
    "glm_moe_dsa": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=4,
                        index_head_dim=16, index_n_heads=16, indexer_types=["full", "full", "shared"]),
    # DeepSeek-V4: hyper-connections (2 residual streams), shared-KV attention with attention sinks, a
    # sliding window and compressed KV: CSA (every 4 tokens, with its indexer's top-4) and HCA (every 8
    # here, 128 as released, so a prompt reaches it); a hash-routed first layer (tid2eid) and top-k routed
    # ones, one shared expert; swiglu_limit low enough that the experts' clamps bite.  16 indexer heads:
    # with 4, exact ties of the ReLU scores at the top-k boundary went either way with the prefill chunking
    "deepseek_v4": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, q_lora_rank=32,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, o_groups=2,
                        o_lora_rank=32, index_n_heads=16, index_head_dim=16, index_topk=4, sliding_window=8,
                        hc_mult=2, num_nextn_predict_layers=0, swiglu_limit=0.5,
                        layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                        mlp_layer_types=["hash_moe", "moe", "moe"]),
    # MiniMax-M2: every layer sparse, no shared expert, sigmoid router whose correction bias sits on the
    # block; q/k norms over all heads; partial rotary (rotary_dim = head_dim / 2 as released)
    # no BOS: the config class's default (200034, the released vocabulary's) lies outside the tiny one
    "minimax_m2": dict(_COMMON, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
                       intermediate_size=32, bos_token_id=None),
    # gpt-oss: sliding (window 8) and full attention alternate, attention sinks and biases; experts
    # transposed with gate/up interleaved, per-expert biases, clamped SwiGLU; router with a bias
    "gpt_oss": dict(_COMMON, head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=96,
                    sliding_window=8, max_position_embeddings=131072),  # yarn x32 over 4096, as released
    "llama": dict(_COMMON, intermediate_size=96),
    "qwen2": dict(_COMMON, intermediate_size=96),
    "qwen3": dict(_COMMON, head_dim=16, intermediate_size=96),
    "gemma3_text": dict(_COMMON, num_key_value_heads=1, head_dim=16, intermediate_size=96, sliding_window=8,
                        tie_word_embeddings=True),
    # Qwen3-VL-MoE: Qwen3-MoE's text model with interleaved M-RoPE (t/h/w sections of head_dim / 2), a
    # ViT of 2 blocks (16-pixel patches, 2x2 merge, one DeepStack merger) whose output feeds layer 0;
    # 2I != H so a transposed expert layout cannot pass unnoticed.  The image tokens are the ids
    # make_tiny_tokenizer(vision=True) gives VISION_SPECIAL_TOKENS
    "qwen3_vl_moe": dict(
        text_config=dict(_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                         intermediate_size=96, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                    mrope_section=[2, 3, 3], mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        vision_start_token_id=261, vision_end_token_id=262, image_token_id=263, video_token_id=264,
        tie_word_embeddings=False),
    # GLM-4.5V / 4.6V: GLM-4-MoE's text model (dense first layer, shared expert, sigmoid router with
    # correction bias, attention biases) with M-RoPE over the rotary half of head_dim (t/h/w sections
    # as released: 8/12/12 of 32 there, 2/3/3 of 8 here); a ViT of 2 blocks (14-pixel patches, learned
    # positions on a 4x4 grid interpolated to the image, 2x2 downsampling, a gated merger).  The image
    # tokens are the ids make_tiny_tokenizer(vision="glm4v_moe") gives its markers
    "glm4v_moe": dict(
        text_config=dict(_COMMON, num_hidden_layers=3, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=48, intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                              partial_rotary_factor=0.5)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, image_size=56, spatial_merge_size=2, temporal_patch_size=2),
        image_start_token_id=261, image_end_token_id=262, image_token_id=263, video_start_token_id=264,
        video_end_token_id=265, video_token_id=266, tie_word_embeddings=False),
    # ERNIE-4.5-VL-MoE: modality-isolated experts (text tokens to text_moe's, image tokens and their
    # markers to vision_moe's, each its own intermediate size and softmax router with a correction
    # bias) plus a shared expert, a dense first layer; M-RoPE (h/w/t sections 3/3/2 of head_dim / 2, as
    # released 22/22/20 of 64); a ViT of 2 blocks (14-pixel patches, one frame each) and the resampler
    # (2x2 spatial merge).  The image tokens are the ids make_tiny_tokenizer(vision="ernie4_5_vl_moe")
    # gives its markers, named on the tokenizer as the processor reads them
    "ernie4_5_vl_moe": dict(
        text_config=dict(_COMMON, head_dim=16, moe_num_experts=8, moe_k=2, moe_intermediate_size=[48, 32],
                         intermediate_size=96, moe_num_shared_experts=1,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2])),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_merge_size=2),
        image_start_token_id=261, image_end_token_id=262, image_token_id=263, video_start_token_id=264,
        video_end_token_id=265, video_token_id=266, tie_word_embeddings=False),
}

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
#: the Qwen-VL image markers, after SPECIAL_TOKENS (ids 261..264) in a vision-language tiny tokenizer
VISION_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
#: per vision-language tiny model: its image and video markers (ids from 261 on, as its config names
#: them) and an image part as its chat template writes it
VISION_MARKERS: dict[str, tuple[list[str], str]] = {
    "qwen3_vl_moe": (VISION_SPECIAL_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>"),
    "glm4v_moe": (["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                   "<|video|>"], "<|begin_of_image|><|image|><|end_of_image|>"),
    "ernie4_5_vl_moe": (["<|IMAGE_START|>", "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>", "<|VIDEO_START|>",
                         "<|VIDEO_END|>", "<|VIDEO_PLACEHOLDER|>"], "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
}
#: families whose processor reads its markers from the tokenizer's named special tokens, in the
#: order of VISION_MARKERS' tokens
VISION_TOKEN_NAMES = {
    "ernie4_5_vl_moe": ("image_start_token", "image_end_token", "image_token", "video_start_token",
                        "video_end_token", "video_token"),
}


def vision_chatml_template(image_markup: str) -> str:
    """ChatML whose message content may be a list of parts, an image part written as ``image_markup``."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}" + image_markup +
            "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


#: ChatML whose message content may be a list of parts, an image part written as Qwen-VL writes it
VISION_CHATML_TEMPLATE = vision_chatml_template(VISION_MARKERS["qwen3_vl_moe"][1])
#: the tiny models whose config is a vision-language one (a processor is written beside the tokenizer)
VISION_ARCHS = tuple(VISION_MARKERS)


def tiny_config(arch: str, **overrides):
    from transformers import AutoConfig

    if arch not in TINY_CONFIGS:
        raise KeyError(f"no tiny config for '{arch}' (have: {', '.join(TINY_CONFIGS)})")
    kw = dict(TINY_CONFIGS[arch])
    kw.update(overrides)
    cfg = AutoConfig.for_model(arch, **kw)
    cfg.dtype = torch.float32
    return cfg


def make_tiny_tokenizer(vision: bool | str = False):
    """Byte-level BPE tokenizer without merges (every byte a token) + ChatML specials (+ the image
    markers and a template taking image parts, with ``vision``: a vision-language tiny model's name,
    or True for Qwen-VL's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    family = "qwen3_vl_moe" if vision is True else vision
    markers, markup = VISION_MARKERS[family] if vision else ([], None)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS + markers})
    if family in VISION_TOKEN_NAMES:  # the same tokens (ids kept), named as the processor reads them
        fast = PreTrainedTokenizerFast(tokenizer_object=fast.backend_tokenizer, eos_token="<|im_end|>",
                                       pad_token="<|endoftext|>", bos_token=None, unk_token=None,
                                       additional_special_tokens=SPECIAL_TOKENS + markers,
                                       model_specific_special_tokens=dict(zip(VISION_TOKEN_NAMES[family], markers)))
    fast.chat_template = vision_chatml_template(markup) if vision else CHATML_TEMPLATE
    return fast


def make_tiny_processor(config, tokenizer):
    """The family's own processor for a tiny vision-language config: its image processor sized to
    the ViT (patch, merge, temporal patch) and at most 128x128 pixels an image, with ``tokenizer``."""
    import transformers

    from ..multimodal.processor import images_only_processor_class

    v = config.vision_config
    pil = {"qwen3_vl_moe": "Qwen2VLImageProcessorPil", "glm4v_moe": "Glm4vImageProcessorPil",
           "ernie4_5_vl_moe": "Ernie4_5_VLMoeImageProcessorPil"}[config.model_type]
    # ERNIE-4.5-VL's tower takes one frame a patch (its temporal merge is for videos): the processor's default
    temporal = {"temporal_patch_size": v.temporal_patch_size} if hasattr(v, "temporal_patch_size") else {}
    image_processor = getattr(transformers, pil)(
        patch_size=v.patch_size, merge_size=v.spatial_merge_size, **temporal,
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return images_only_processor_class(config)(image_processor=image_processor, tokenizer=tokenizer,
                                                chat_template=tokenizer.chat_template)


def random_model(arch: str, seed: int = 0, **overrides):
    """An fp32 transformers model of ``arch`` with random weights (norms and biases randomised too)."""
    from ..optimize_rules import auto_model_class

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = auto_model_class(cfg).from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms, biases, router biases: away from their trivial init
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
            if name.endswith("tid2eid"):  # hash routing: distinct experts per token id
                n_experts = model.config.num_local_experts
                b.copy_(torch.stack([torch.randperm(n_experts)[:b.shape[1]] for _ in range(b.shape[0])]))
        # routers with clearer margins so tiny numerical differences rarely flip experts
        for name, mod in model.named_modules():
            if name.endswith(("mlp.gate", "mlp.router")) and hasattr(mod, "weight") and mod.weight.dim() == 2:
                mod.weight.mul_(6.0)
    model.eval()
    return model


def write_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, with_tokenizer: bool = True, **overrides):
    """Write a tiny random ``arch`` model folder (config, safetensors, tokenizer) and return the model."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = random_model(arch, seed, **overrides)
    if with_tokenizer:
        vision = arch in VISION_ARCHS
        tok = make_tiny_tokenizer(vision=arch if vision else False)
        text_config = model.config.get_text_config()
        assert len(tok) <= text_config.vocab_size, "tiny vocab must hold the tokenizer"
        for cfg in {id(c): c for c in (model.config, text_config)}.values():
            cfg.eos_token_id = tok.eos_token_id
            cfg.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        if vision:
            image_token = VISION_MARKERS[arch][0][2]
            assert tok.convert_tokens_to_ids(image_token) == model.config.image_token_id
            make_tiny_processor(model.config, tok).save_pretrained(out)
        tok.save_pretrained(out)
    model.save_pretrained(out)
    (out / "tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return model
