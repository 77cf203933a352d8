"""gpt-oss through the shipped rules: the experts' own layout (transposed, gate/up interleaved),
their biases and the clamped SwiGLU on every expert backend, against the unmodified transformers
model.  fp32 / bf16 parity of the shipped CPU rules runs in tests/generation/test_parity.py (the
tiny config is in TINY_CONFIGS).  Measured on the tiny model (max |Δ| relative to max |logit|):

==========================  ==========================================================
rules / backend             logits
==========================  ==========================================================
GptOss-cpu (llamafile F32)  1.2e-6, 16 greedy tokens identical (test_parity)
KExpertsTorch               1.3e-6, 16 greedy tokens identical
AMXBF16                     2.5e-3
AMXInt8                     2.8e-2 (12 tokens); 24 tokens: median 1.0e-2, one routing flip 0.37
bf16 model (llamafile)      1.9e-2 vs transformers in bf16 (test_parity's 2e-2); 1.2e-2 vs
                            fp32, as close as transformers' own bf16 run (1.15e-2)
==========================  ==========================================================

The experts alone with inputs large enough that the clamp is active (|gate|, |up| > limit):
llamafile F32 2.7e-7, KExpertsTorch 0 (the same torch ops), AMXBF16 3.8e-3, AMXInt8 1.8e-2.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from ktransformers import load_model
from ktransformers.errors import WeightError
from ktransformers.optimize_rules import RULES_DIR

from .family_checks import (BACKEND_SWAPS, EXPERTS_CPU, check_expert_backend, load_with_picked_rules,
                            model_with_backend, rel_err)

ARCH = "gpt_oss"
CPU_RULES = RULES_DIR / "GptOss-cpu.yaml"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # hf: the shared fixture (conftest.py)


def test_load_model_picks_the_gpt_oss_rules(tiny_model_dir):
    cfg, model = load_with_picked_rules(tiny_model_dir(ARCH), "GptOssForCausalLM", "GptOss")
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    for layer in model.model.layers:
        assert type(layer.mlp).__name__ == "GptOssMLP" and type(layer.mlp.router).__name__ == "GptOssTopKRouter"
        op = layer.mlp.experts.generate_op
        assert op.name == "KExpertsCPU" and op.backend == "llamafile" and op.activation == "clamp_swiglu"
        assert op.layout.transposed and op.layout.interleaved and op.layout.bias
        assert layer.self_attn.q_proj.generate_op.name == "KLinearCPU"
        assert type(layer.self_attn).__name__ == "GptOssAttention"


@pytest.mark.parametrize("backend", list(BACKEND_SWAPS))
def test_other_expert_backends(backend, tiny_model_dir, hf):
    old, new, tol = BACKEND_SWAPS[backend]
    model = model_with_backend(tiny_model_dir(ARCH), CPU_RULES, (old, new))
    # AMXInt8: int8 weights flip the router's choice at a near tie (one position of 24 here, 0.37): the
    # typical position is held to the tolerance, the worst one only to a sane bound
    check_expert_backend(model, hf, tol, int8_worst=0.5 if backend == "AMXInt8" else None)


@pytest.mark.parametrize("backend,tol", [("llamafile", 1e-5), ("KExpertsTorch", 1e-6), ("AMXBF16", 1e-2),
                                         ("AMXInt8", 3e-2)])
def test_experts_with_the_clamp_active(backend, tol, tiny_model_dir, hf):
    """Inputs large enough that gate and up exceed ±limit: the clamp of gate (above only), of up
    (both sides), the (up + 1) term and the biases inside the kernel match GptOssExperts."""
    rules = CPU_RULES.read_text()
    if backend == "KExpertsTorch":
        rules = rules.replace(EXPERTS_CPU, "generate_op: KExpertsTorch")
    else:
        rules = rules.replace("backend: llamafile", f"backend: {backend}")
    d = tiny_model_dir(ARCH)
    model = load_model(d, model_path=d, rules=rules, allow_unmatched=False)
    g = torch.Generator().manual_seed(5)
    x = 40.0 * torch.randn(70, hf.config.hidden_size, generator=g)  # > prefill_threshold tokens too
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(70)])
    w = torch.softmax(torch.randn(70, 2, generator=g), dim=-1)
    ref_experts = hf.model.layers[0].mlp.experts
    gu = x @ ref_experts.gate_up_proj[0] + ref_experts.gate_up_proj_bias[0]
    limit = ref_experts.limit
    assert (gu[:, 0::2] > limit).any() and (gu[:, 1::2] > limit).any() and (gu[:, 1::2] < -limit).any()
    with torch.no_grad():
        ref = ref_experts(x, idx, w)
        got = model.model.layers[0].mlp.experts(x, idx, w)
    assert rel_err(got, ref) <= tol


def test_generator_chunked_prefill_past_the_sliding_window(tiny_model_dir, hf):
    """The project's engine (static cache, chunked prefill of 5 tokens, then decode) over a prompt
    longer than the sliding window (8): the sliding layer's cache keeps the window across chunks and
    decode steps, the tokens equal transformers' greedy ones."""
    from ktransformers.generation import Generator, SamplingParams

    d = tiny_model_dir(ARCH)
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    gen = Generator(load_model(d, model_path=d), tok, chunk_size=5)
    gen.eos_ids = set()
    ids = gen.apply_chat_template([{"role": "user", "content": "Hello there, how are you today?"}])
    assert len(ids) > 3 * hf.config.sliding_window
    ours = [e.token_id for e in gen.stream(ids, SamplingParams(max_new_tokens=16))][:-1]
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref


def test_wrong_expert_shapes_name_the_layout(tiny_model_dir, tmp_path):
    """A checkpoint whose down_proj is in the stacked layout instead of the model's: one line naming
    the tensor, both shapes and the module's layout."""
    d = tiny_model_dir(ARCH)
    sd = load_file(d / "model.safetensors")
    key = "model.layers.0.mlp.experts.down_proj"
    sd[key] = sd[key].transpose(1, 2).contiguous()
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"down_proj' has shape \[8, 64, 96\], the model expects \[8, 96, 64\] "
                                          r"\(GptOssExperts layout: transposed, gate/up interleaved, per-expert biases\)"):
        load_model(tmp_path, model_path=d)
