"""A rule file in the reference system's style (its operator paths, Marlin ops, kwarg spellings)
loads unmodified and generates what the unmodified transformers model generates."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ktransformers import load_model
from ktransformers.optimize.explain import alias_lines
from ktransformers.optimize.rules import parse_rules

# DeepSeek-V3 layout of the reference system's rule file, devices set to the CPU
DEEPSEEK_V3_REF = r"""
- match:
    class: ktransformers.models.modeling_deepseek_v3.DeepseekV3RotaryEmbedding
  replace:
    class: ktransformers.operators.RoPE.YarnRotaryEmbeddingV3
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
- match:
    name: "^lm_head$"
    class: torch.nn.Linear
  replace:
    class: ktransformers.operators.linear.KTransformersLinear
    kwargs: {generate_device: "cpu", prefill_device: "cpu", generate_op: "KLinearMarlin", prefill_op: "KLinearTorch"}
- match:
    name: "^model\\.layers\\.(?!.*self_attn\\.kv_b_proj).*$"
    class: torch.nn.Linear
  replace:
    class: ktransformers.operators.linear.KTransformersLinear
    kwargs: {generate_device: "cpu", prefill_device: "cpu", generate_op: "KLinearMarlin", prefill_op: "KLinearTorch"}
- match:
    name: "^model\\.layers\\..*\\.mlp$"
    class: ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE
  replace:
    class: ktransformers.operators.experts.KDeepseekV3MoE
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
- match:
    class: ktransformers.models.modeling_deepseek_v3.MoEGate
  replace:
    class: ktransformers.operators.gate.KMoEGateDeepSeekV3
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
- match:
    name: "^model\\.layers\\..*\\.mlp\\.experts$"
  replace:
    class: ktransformers.operators.experts.KTransformersExperts
    kwargs: {prefill_device: "cpu", prefill_op: "KExpertsTorch", generate_device: "cpu", generate_op: "KExpertsCPU", out_device: "cpu"}
  recursive: False
- match:
    name: "^model\\.layers\\..*\\.self_attn$"
  replace:
    class: ktransformers.operators.attention.KDeepseekV2Attention
    kwargs: {generate_device: "cpu", prefill_device: "cpu", absorb_for_prefill: False, chunck_size: 16}
- match:
    name: "^model$"
  replace:
    class: "ktransformers.operators.models.KDeepseekV2Model"
    kwargs: {per_layer_prefill_intput_threshold: 0}
- match:
    name: "^model.embed_tokens"
  replace:
    class: "default"
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
"""


# its newer DeepSeek-V3 files name the classes of ``modeling_deepseek`` (V2's file) with V3's rope class
DEEPSEEK_V3_REF_V2_PATHS = (DEEPSEEK_V3_REF
                            .replace("modeling_deepseek_v3.DeepseekV3RotaryEmbedding",
                                     "modeling_deepseek.DeepseekV3YarnRotaryEmbedding")
                            .replace("modeling_deepseek_v3.DeepseekV3MoE", "modeling_deepseek.DeepseekV2MoE")
                            .replace("modeling_deepseek_v3.MoEGate", "modeling_deepseek.MoEGate"))


@pytest.mark.parametrize("rules", [DEEPSEEK_V3_REF, DEEPSEEK_V3_REF_V2_PATHS], ids=["v3_paths", "v2_paths"])
def test_reference_style_deepseek_v3_rules_generate_like_transformers(tiny_model_dir, rules):
    assert "modeling_deepseek_v3" not in rules or rules is DEEPSEEK_V3_REF
    lines = alias_lines(parse_rules(rules, "DeepSeek-V3-Chat.yaml"))
    assert "KDeepseekV3MoE → KMoEBlock (MoE block: router, routed experts overlapped with shared experts)" in lines
    assert "KMoEGateDeepSeekV3 → KMoEGate (DeepSeek-style router)" in lines
    d = tiny_model_dir("deepseek_v3")
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(d, model_path=d, rules=rules)
    assert type(model.model.layers[1].mlp).__name__ == "KMoEBlock"
    assert type(model.model.layers[1].mlp.gate).__name__ == "KMoEGate"
    assert model.model.layers[1].mlp.experts.generate_op.name == "KExpertsCPU"
    assert model.model.layers[1].self_attn.chunk_size == 16  # chunck_size, the reference spelling
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # dense layer 0 left alone
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        assert torch.equal(ref.generate(ids, **kw), model.generate(ids, **kw))
