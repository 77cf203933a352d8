"""DeepSeek-V4's routed experts clamp before the gated activation — silu(min(gate, limit)) *
clamp(up, +-limit) — a form no CPU expert kernel computes (gpt-oss's clamped SwiGLU adds 1 to up and
scales the sigmoid).  No rule file ships for the family: KExpertsCPU refuses the experts by name
rather than dropping the clamp, KExpertsTorch computes them, against the unmodified transformers model.
The release's checkpoint names (``attn.attn_sink``, ``hc_attn_fn`` ...) are not mapped to the module
names by the weight sources either.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ktransformers import load_model
from ktransformers.errors import RuleError

# experts on the op under test, everything else placed as it is
RULES = """
- match:
    name: "^model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\.experts$"
  replace:
    class: KTransformersExperts
    kwargs:
      generate_device: cpu
      generate_op: {op}
  recursive: false
- match:
    name: "^model$"
  replace:
    class: default
    device: cpu
"""


def _tiny_v4(limit: float):
    cfg = AutoConfig.for_model(
        "deepseek_v4", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, q_lora_rank=32, vocab_size=320, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=16, index_topk=4,
        sliding_window=8, hc_mult=2, max_position_embeddings=256, num_nextn_predict_layers=0,
        mlp_layer_types=["hash_moe", "moe"], swiglu_limit=limit)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name + ".":
                p.normal_(0.0, 0.3)  # gate / up well past the limit
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, 8, b.shape))
    return model


@pytest.fixture(scope="module")
def hf():
    return _tiny_v4(limit=0.5)


@pytest.fixture(scope="module")
def v4_dir(hf, tmp_path_factory):
    """The module names as they are (``save_pretrained`` writes the release's own names, which the
    weight sources do not map back yet)."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("tiny-deepseek_v4")
    hf.config.save_pretrained(d)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, d / "model.safetensors")
    return d


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def test_cpu_kernels_refuse_the_clamped_silu(v4_dir):
    with pytest.raises(RuleError, match=r"mlp\.experts: KExpertsCPU has no kernel for activation 'clamp_silu'"):
        load_model(v4_dir, model_path=v4_dir, rules=RULES.format(op="KExpertsCPU"))


def test_torch_experts_compute_the_clamp(v4_dir, hf):
    model = load_model(v4_dir, model_path=v4_dir, rules=RULES.format(op="KExpertsTorch"), allow_unmatched=True)
    experts = model.model.layers[1].mlp.experts
    assert experts.generate_op.name == "KExpertsTorch" and experts.generate_op.activation == "clamp_silu"
    g = torch.Generator().manual_seed(1)
    x = 4.0 * torch.randn(9, hf.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)])
    w = torch.softmax(torch.randn(9, 2, generator=g), dim=-1)
    ref_experts = hf.model.layers[1].mlp.experts
    with torch.no_grad():
        ref = ref_experts(x, idx, w)
        got = experts(x, idx, w)
        gate, up = (x @ ref_experts.gate_up_proj[0].T).chunk(2, dim=-1)
        unclamped = torch.nn.functional.silu(gate) * up
    assert (gate > ref_experts.limit).any() and (up.abs() > ref_experts.limit).any()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (unclamped.abs().max() > 2 * ref_experts.limit)  # the clamp changes the result
    ids = torch.randint(0, 300, (1, 12), generator=g)
    with torch.no_grad():
        a, b = model(ids).logits, hf(ids).logits
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
