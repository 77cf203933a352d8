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
from ktransformers.optimize_rules import RULES_DIR, default_rule_file

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
BACKEND_TOL = {"AMXBF16": 1e-2, "AMXInt8": 3e-2}  # as test_cpu_ops: bf16 weights / int8 weights


def _ids(n=12, seed=0):
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def _rel(got, ref) -> float:
    return (got - ref).abs().max().item() / ref.abs().max().item()


def _hf_on(source):
    """The unmodified HF model with every weight dequantized from ``source``."""
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters on meta, buffers (rotary tables) real
        model = AutoModelForCausalLM.from_config(source.config())
    sd = {k: source.tensor(k, dtype=torch.float32) for k in model.state_dict()}
    model.load_state_dict(sd, assign=True, strict=True)
    return model.eval()


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.mark.parametrize("arch", FAMILIES)
def test_load_model_picks_the_family_rules(arch, tiny_model_dir):
    from transformers import AutoConfig

    name, stem, block_cls, router_cls = FAMILIES[arch]
    d = tiny_model_dir(arch)
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.architectures == [name]
    assert default_rule_file(cfg, cuda=False) == RULES_DIR / f"{stem}-cpu.yaml"
    assert default_rule_file(cfg, cuda=True) == RULES_DIR / f"{stem}.yaml"
    model = load_model(d, model_path=d, allow_unmatched=False)
    sparse = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert sparse
    for mlp in sparse:
        assert type(mlp).__name__ == block_cls and type(mlp.gate).__name__ == router_cls
        assert type(mlp.experts).__name__ == "KTransformersExperts"
        op = mlp.experts.generate_op
        assert op.name == "KExpertsCPU" and op.backend == "llamafile"


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
    assert _rel(got, ref) <= 1e-5
    assert (ref - ref_routed).abs().max() > 1e-3  # the shared expert contributes


@pytest.mark.parametrize("backend", list(BACKEND_TOL))
@pytest.mark.parametrize("arch", FAMILIES)
def test_other_expert_backends(arch, backend, tiny_model_dir):
    stem = FAMILIES[arch][1]
    rules = (RULES_DIR / f"{stem}-cpu.yaml").read_text().replace("backend: llamafile", f"backend: {backend}")
    d = tiny_model_dir(arch)
    model = load_model(d, model_path=d, rules=rules, allow_unmatched=False)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = _ids(24, seed=3)
    with torch.no_grad():
        assert _rel(model(ids).logits, hf(ids).logits) <= BACKEND_TOL[backend]


@pytest.mark.parametrize("arch", GGUF_CONFIG_KEYS)
def test_gguf_from_our_converter(arch, tiny_model_dir, tmp_path):
    """F32: the config comes back from the metadata alone and logits match the HF model; Q8_0 through
    the shipped rules (CPU kernels on the Q8_0 bytes) is close to the HF model on the dequantized file
    (figures in the module docstring)."""
    from ktransformers.convert import convert
    from ktransformers.weights.gguf_source import GGUFSource

    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    f32 = convert(d, tmp_path / "f32.gguf", "F32", "F32", "F32")
    src = GGUFSource(f32)
    src.validate()
    cfg = src.config()
    for key in GGUF_CONFIG_KEYS[arch]:
        assert getattr(cfg, key) == getattr(hf.config, key), key
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        assert _rel(load_model(f32, allow_unmatched=False)(ids).logits, ref) <= 1e-4
        q8 = convert(d, tmp_path / "q8.gguf", "Q8_0", "Q8_0", "Q8_0")
        deq = _hf_on(GGUFSource(q8))(ids).logits
        d = (load_model(q8, allow_unmatched=False)(ids).logits - deq).abs()[0]
    # the kernels quantize activations to 8 bits: llama.cpp's own bar (fixtures README, test_gguf_inject)
    assert d.mean() <= 0.05 and d.max(1).values.median() <= 0.2 and d.max() <= 0.75


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
    ids = _ids()
    with torch.no_grad():
        assert _rel(model(ids).logits, hf(ids).logits) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU+GPU rule files)")
@pytest.mark.parametrize("arch", FAMILIES)
def test_gpu_rules_cross_device_parity(arch, tiny_model_dir):
    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(d, model_path=d, allow_unmatched=False)
    assert any(p.generate_device.type == "cuda" for p in model.kt_plan.placements.values())
    ids = _ids()
    with torch.no_grad():
        assert _rel(model(ids).logits.cpu(), hf(ids).logits) <= 1e-3
    a = model.generate(ids[:, :4], max_new_tokens=16, do_sample=False).cpu()
    assert torch.equal(a, hf.generate(ids[:, :4], max_new_tokens=16, do_sample=False))


@pytest.mark.parametrize("arch", FAMILIES)
def test_generator_stream_equals_hf_greedy(arch, tiny_model_dir):
    """The project's engine (chunked prefill of 5 tokens, then decode) on the shipped rules gives the
    unmodified model's greedy tokens: for Qwen3.5-MoE the linear-attention state carries across the
    prefill chunks and the decode steps in the cache."""
    from transformers import AutoTokenizer

    from ktransformers.generation import Generator, SamplingParams

    d = tiny_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    gen = Generator(load_model(d, model_path=d), tok, chunk_size=5)
    gen.eos_ids = set()
    ids = gen.apply_chat_template([{"role": "user", "content": "Hello there, how are you today?"}])
    ours = [e.token_id for e in gen.stream(ids, SamplingParams(max_new_tokens=16))][:-1]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert ours == ref
