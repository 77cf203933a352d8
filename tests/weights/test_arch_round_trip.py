"""Every supported architecture: tiny random HF model -> converter (F32) -> GGUFSource -> HF model
built from the GGUF metadata alone -> logits equal to the original's (max abs <= 1e-4, measured
<= 1e-5).  Covers llama's Q/K permutation, Mixtral as llama+experts, qwen2moe's shared expert and
its gate, DeepSeek-V2 (no q_lora, softmax router) and gemma3's +1 norms, none of which has a
llama.cpp fixture here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ktransformers.convert import convert
from ktransformers.weights.gguf_source import GGUFSource

from .test_gguf_source import build_model, logits

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
CASES = {
    "llama": dict(rms_norm_eps=1e-5),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(),
    "qwen3": dict(head_dim=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=16, n_shared_experts=1, num_key_value_heads=4),
    "gemma3_text": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
}
EXPECT = {"llama": "LlamaConfig", "mixtral": "MixtralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
          "qwen2_moe": "Qwen2MoeConfig", "deepseek_v2": "DeepseekV2Config", "gemma3_text": "Gemma3TextConfig"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(CASES))
def test_arch_round_trip(tmp_path, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **CASES[model_type]})
    cfg.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(0.2 * torch.randn_like(p) + (0.0 if model_type == "gemma3_text" else 1.0))
            elif n.endswith("bias") or "e_score" in n:
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    ids = list(range(3, 40, 3))
    ref = logits(model, ids)
    out = convert(tmp_path / "hf", tmp_path / "m.gguf", "F32", "F32", "F32")
    src = GGUFSource(out)
    src.validate()
    got_cfg = src.config()
    assert type(got_cfg).__name__ == EXPECT[model_type]
    lg = logits(build_model(src), ids)
    assert np.abs(lg - ref).max() <= 1e-4
    if model_type == "llama":
        # quantized Q/K rows come back in HF order through raw() as well
        q = src.tensor("model.layers.0.self_attn.q_proj.weight")
        r = src.raw("model.layers.0.self_attn.q_proj.weight")
        from ktransformers.weights.dequant import dequantize

        assert torch.equal(dequantize(r.data, r.ggml_type, r.shape), q)
