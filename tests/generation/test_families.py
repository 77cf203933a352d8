"""MoE families with shipped rules beyond the original set: GLM-4-MoE, Qwen3.5-MoE (text part),
MiniMax-M2.

Parity (fp32 ≤ 1e-4 relative with 16 greedy tokens identical, bf16 ≤ 2e-2) runs in
test_parity.py for every tiny config; here: which rules load_model picks, what they place,
the other expert backends, the engine's chunked prefill, and GGUF files written by this
project's converter and by llama.cpp's.  Measured on the tiny models (relative to max |logit|):

================  =======  ======  =======  =======  ===============================
family            fp32     bf16    AMXBF16  AMXInt8  GGUF F32 (ours / llama.cpp's)
================  =======  ======  =======  =======  ===============================
glm4_moe          6.8e-7   1.4e-2  1.0e-3   7.6e-3   6.8e-7 / 6.8e-7
qwen3_5_moe_text  5.4e-6   1.4e-2  7.5e-3   2.8e-2   5.5e-6 / 5.5e-6
minimax_m2        3.7e-7   4.4e-3  8.1e-4   5.2e-3   3.7e-7 / 3.7e-7
================  =======  ======  =======  =======  ===============================

Qwen3.5-MoE's random DeltaNet layer amplifies rounding (transformers' own bf16 run is 16 % off
its fp32 run on a four-layer tiny model), hence its larger bf16 / AMXInt8 figures.
Q8_0 through the shipped rules vs the HF model on the dequantized file: mean / median
per-position max / max abs 0.005 / 0.020 / 0.033 (GLM), 0.006 / 0.015 / 0.10 (MiniMax),
0.018 / 0.060 / 0.15 (Qwen3.5-MoE: the DeltaNet layer amplifies the 8-bit activations).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ktransformers import load_model
from ktransformers.optimize_rules import RULES_DIR

from tests.operators.family_checks import (BACKEND_SWAPS, assert_moe_block_on_cpu_kernels, check_expert_backend,
                                           check_gpu_rules_cross_device_parity, check_our_converter_f32_and_q8,
                                           generator_greedy, load_with_picked_rules, model_with_backend, prompt_ids,
                                           rel_err)

ROOT = Path(__file__).resolve().parents[2]
# llama.cpp source tree (its convert_hf_to_gguf.py); the team's checkout keeps one beside shared/
LLAMA_CPP = Path(os.environ.get("KT_LLAMA_CPP_DIR", "/nonexistent"))  # a llama.cpp source tree (bench-only peer)

# model_type -> (architecture, shipped rule stem, the MoE block's class once placed, the router's)
FAMILIES = {
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4Moe", "KMoEBlock", "KMoEGate"),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "Qwen3_5Moe", "KMoEBlock", "Qwen3_5MoeTopKRouter"),
    # the block's own forward: its router takes the correction bias the block holds
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2", "MiniMaxM2SparseMoeBlock", "MiniMaxM2TopKRouter"),
}
# families with a llama.cpp GGUF architecture -> config fields that must come back from the metadata
GGUF_CONFIG_KEYS = {
    "glm4_moe": ("num_hidden_layers", "head_dim", "rope_parameters", "first_k_dense_replace", "n_shared_experts",
                 "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "attention_bias",
                 "use_qk_norm", "moe_intermediate_size", "intermediate_size"),
    "minimax_m2": ("num_hidden_layers", "head_dim", "rope_parameters", "num_local_experts", "num_experts_per_tok",
                   "intermediate_size", "num_key_value_heads"),
    # 2 key heads, 4 value heads: llama.cpp's V-head reordering written and undone
    "qwen3_5_moe_text": ("num_hidden_layers", "head_dim", "rope_parameters", "layer_types", "linear_conv_kernel_dim",
                         "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                         "linear_num_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size"),
}
AMX_BACKENDS = ("AMXBF16", "AMXInt8")  # bf16 weights / int8 weights


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.mark.parametrize("arch", FAMILIES)
def test_load_model_picks_the_family_rules(arch, tiny_model_dir):
    name, stem, block_cls, router_cls = FAMILIES[arch]
    _, model = load_with_picked_rules(tiny_model_dir(arch), name, stem)
    sparse = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert sparse
    for mlp in sparse:
        assert_moe_block_on_cpu_kernels(mlp, router_cls, block=block_cls)
        assert type(mlp.experts).__name__ == "KTransformersExperts"


def test_glm4moe_dense_first_layers_and_shared_experts(tiny_model_dir):
    """Layer 0 is dense (its MLP kept, linears on the CPU kernels); MoE layers add the shared expert."""
    d = tiny_model_dir("glm4_moe")
    model = load_model(d, model_path=d, allow_unmatched=False)
    dense = model.model.layers[0].mlp
    assert type(dense).__name__ == "Glm4MoeMLP" and dense.gate_proj.generate_op.name == "KLinearCPU"
    moe = model.model.layers[1].mlp
    assert moe.shared_experts.down_proj.generate_op.name == "KLinearCPU"
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    x = torch.randn(1, 5, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.model.layers[1].mlp(x)
        got = moe(x)
        ref_routed = ref - hf.model.layers[1].mlp.shared_experts(x)
    assert rel_err(got, ref) <= 1e-5
    assert (ref - ref_routed).abs().max() > 1e-3  # the shared expert contributes


@pytest.mark.parametrize("backend", AMX_BACKENDS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_other_expert_backends(arch, backend, tiny_model_dir):
    old, new, tol = BACKEND_SWAPS[backend]
    d = tiny_model_dir(arch)
    model = model_with_backend(d, RULES_DIR / f"{FAMILIES[arch][1]}-cpu.yaml", (old, new))
    check_expert_backend(model, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), tol)


@pytest.mark.parametrize("arch", GGUF_CONFIG_KEYS)
def test_gguf_from_our_converter(arch, tiny_model_dir, tmp_path):
    """F32: the config comes back from the metadata alone and logits match the HF model; Q8_0 through
    the shipped rules (CPU kernels on the Q8_0 bytes) is close to the HF model on the dequantized file
    (figures in the module docstring)."""
    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    check_our_converter_f32_and_q8(d, hf, tmp_path, GGUF_CONFIG_KEYS[arch])


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"llama.cpp's converter not found at {LLAMA_CPP} (set KT_LLAMA_CPP_DIR)")
@pytest.mark.parametrize("arch", GGUF_CONFIG_KEYS)
def test_gguf_from_llama_cpp_converter(arch, tiny_model_dir, tmp_path):
    """llama.cpp's own names and metadata (GLM-4-MoE: block_count includes the NextN layer;
    MiniMax-M2: the correction bias on the block)."""
    d = tiny_model_dir(arch)
    out = tmp_path / "lcpp.gguf"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "llama_cpp_convert.py"), str(LLAMA_CPP), str(d), str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(out, allow_unmatched=False)
    assert model.config.num_hidden_layers == hf.config.num_hidden_layers
    ids = prompt_ids()
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU+GPU rule files)")
@pytest.mark.parametrize("arch", FAMILIES)
def test_gpu_rules_cross_device_parity(arch, tiny_model_dir):
    d = tiny_model_dir(arch)
    check_gpu_rules_cross_device_parity(d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())


@pytest.mark.parametrize("arch", FAMILIES)
def test_generator_stream_equals_hf_greedy(arch, tiny_model_dir):
    """The project's engine (chunked prefill of 5 tokens, then decode) on the shipped rules gives the
    unmodified model's greedy tokens: for Qwen3.5-MoE the linear-attention state carries across the
    prefill chunks and the decode steps in the cache."""
    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours, ref = generator_greedy(load_model(d, model_path=d), hf, d, chunk_size=5, min_prompt=0)
    assert ours == ref
