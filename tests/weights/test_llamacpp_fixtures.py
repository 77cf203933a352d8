"""GGUF files written by llama.cpp's own converter load, for every supported architecture.

``tests/fixtures/llamacpp/<arch>.gguf`` were made once by ``scripts/make_llamacpp_fixtures.py``
(llama.cpp's ``convert_hf_to_gguf.py --outtype bf16`` on a tiny model whose weights are
bf16-exact, gpt-oss's experts BF16 as well (not MXFP4: the tiny model's are not on its grid); Qwen3-Next and Qwen3.5-MoE ``--outtype f32 --no-mtp``, DeepSeek-V3.2, GLM-5 and DeepSeek-V4 ``--outtype f32`` (DeepSeek-V4's
experts MXFP4, from a release-layout checkpoint), see the script); ``<arch>.json`` holds the HF fp32 logits of that model and a tokenizer probe (and, for
the sparse-attention models, how far the indexers' top-k key choices are from flipping).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ktransformers.weights import open_weights
from ktransformers.weights.gguf_source import GGUFSource

from .test_gguf_source import build_model, logits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v2", "llama", "qwen2", "qwen3",
         "gemma3_text", "qwen3_next", "deepseek_v32", "glm_moe_dsa", "deepseek_v4", "qwen3_5_moe_text",
         "glm4_moe", "minimax_m2", "gpt_oss")
CONFIG = {"qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig", "mixtral": "MixtralConfig",
          "deepseek_v3": "DeepseekV3Config", "deepseek_v2": "DeepseekV2Config", "llama": "LlamaConfig",
          "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gemma3_text": "Gemma3TextConfig",
          "qwen3_next": "Qwen3NextConfig", "deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig",
          "deepseek_v4": "DeepseekV4Config", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
          "glm4_moe": "Glm4MoeConfig", "minimax_m2": "MiniMaxM2Config", "gpt_oss": "GptOssConfig"}
#: config fields the metadata must give back as the tiny model has them (the fixtures' HF models are
#: the tiny configs, but for the overrides of scripts/make_llamacpp_fixtures.py)
CONFIG_KEYS = {
    # linear_num_key_heads 2 != linear_num_value_heads 4: llama.cpp's V-head reordering is undone
    "qwen3_5_moe_text": ("num_hidden_layers", "hidden_size", "head_dim", "num_attention_heads",
                         "num_key_value_heads", "rope_parameters", "layer_types", "linear_conv_kernel_dim",
                         "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                         "linear_num_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size", "vocab_size", "tie_word_embeddings",
                         "max_position_embeddings"),
}


def reference(arch: str) -> dict:
    return json.loads((FIXTURES / f"{arch}.json").read_text())


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.fixture(autouse=True)
def _private_tokenizer_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_matches_hf(arch):
    """Names, shapes, metadata -> config and dequantization: HF logits within 1e-4 relative."""
    ref = reference(arch)
    src = open_weights(FIXTURES / f"{arch}.gguf")
    assert isinstance(src, GGUFSource)
    src.validate()
    cfg = src.config()
    assert type(cfg).__name__ == CONFIG[arch]
    got = logits(build_model(src), ref["token_ids"])
    assert rel_err(got, np.array(ref["hf_logits"], dtype=np.float32)) <= 1e-4
    tok = src.tokenizer()
    probe = ref["tokenizer_probe"]
    assert tok.encode(probe["text"], add_special_tokens=False) == probe["ids"]


@pytest.mark.parametrize("arch", CONFIG_KEYS)
def test_fixture_config_from_metadata(arch):
    """The config built from llama.cpp's metadata alone equals the tiny model's where it matters."""
    from ktransformers.util.tiny_models import tiny_config

    cfg, want = open_weights(FIXTURES / f"{arch}.gguf").config(), tiny_config(arch)
    for key in CONFIG_KEYS[arch]:
        assert getattr(cfg, key) == getattr(want, key), key
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # stored f32


@pytest.mark.parametrize("arch,bos,adds_bos",
                         [("deepseek_v32", "<|endoftext|>", True), ("glm_moe_dsa", "[gMASK]", False)])
def test_sparse_attention_fixture_specials(arch, bos, adds_bos):
    """llama.cpp's vocab writers for these: DeepSeek-V3.2's BOS added to every prompt
    (``add_bos_token``), GLM-5's ``[gMASK]`` as BOS (not added)."""
    tok = open_weights(FIXTURES / f"{arch}.gguf").tokenizer()
    assert tok.bos_token == bos
    assert (tok.encode("hi")[0] == tok.bos_token_id) == adds_bos
    assert tok.encode("hi", add_special_tokens=False) == [71, 72]


#: fixtures written F32 (their float kernels take fp32 activations on every tier)
F32_FIXTURES = ("qwen3_next", "deepseek_v32", "glm_moe_dsa", "deepseek_v4", "qwen3_5_moe_text")


#: F32 fixtures whose routed experts llama.cpp writes MXFP4 (DeepSeek-V4, always): the CPU kernels
#: quantize activations to 8 bits for MXFP4 products, as llama.cpp does (measured 3.1e-3 on every
#: tier; with the experts dequantized, 5e-7: tests/operators/test_deepseek_v4_gguf.py)
MXFP4_EXPERTS = {"deepseek_v4": 1e-2}


def kernel_bf16_tolerance() -> float:
    """Relative logits tolerance of the CPU kernels on these BF16 files: 1e-4 where the tier's BF16
    kernel takes fp32 activations (measured <= 2e-6); 3e-2 where it takes bf16 ones (``vdpbf16ps`` on
    AVX512-BF16, as llama.cpp does there): each activation is rounded to 8 significant bits (2^-9
    relative) before every BF16 product, which reaches 0.5-1.4e-2 of the largest logit through these
    two-layer models (Gemma-3's scaled embeddings the most); the same files on the avx2 / avx512 tiers
    (fp32 activations; ``KT_ISA=avx512`` here) stay within 2e-6."""
    from ktransformers.kernels import activation_format

    return 3e-2 if activation_format("BF16") == "bf16" else 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_through_load_model(arch):
    """The whole loader (shipped -cpu rules, operators, CPU kernels) on the llama.cpp file."""
    from ktransformers import load_model

    ref = reference(arch)
    model = load_model(FIXTURES / f"{arch}.gguf", device="cpu")
    with torch.no_grad():
        got = model(torch.tensor([ref["token_ids"]])).logits[0].float().numpy()
    tol = MXFP4_EXPERTS.get(arch, 1e-4) if arch in F32_FIXTURES else kernel_bf16_tolerance()
    assert rel_err(got, np.array(ref["hf_logits"], dtype=np.float32)) <= tol


def test_gpt_oss_experts_left_to_transformers(tmp_path):
    """Rules that leave gpt-oss's experts to transformers' own module: its transposed, gate/up
    interleaved parameters (and biases) are built from llama.cpp's split expert tensors."""
    from ktransformers import load_model

    rules = tmp_path / "plain.yaml"
    rules.write_text('- match: {name: "^lm_head$"}\n  replace: {class: default, kwargs: {generate_device: cpu}}\n')
    ref = reference("gpt_oss")
    model = load_model(FIXTURES / "gpt_oss.gguf", device="cpu", rules=rules)
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "GptOssExperts" and experts.gate_up_proj.shape == (8, 64, 192)
    with torch.no_grad():
        got = model(torch.tensor([ref["token_ids"]])).logits[0].float().numpy()
    assert rel_err(got, np.array(ref["hf_logits"], dtype=np.float32)) <= 1e-4


def test_qwen2moe_one_dimensional_shared_expert_gate(tmp_path):
    """Some writers store ``ffn_gate_inp_shexp`` as ``[n_embd]``, llama.cpp's own reading of it."""
    from gguf_files import copy_gguf

    squeezed = []

    def squeeze(name, data, qt):
        if name.endswith("ffn_gate_inp_shexp.weight"):
            squeezed.append(name)
            data = data.reshape(-1)
        return data, qt

    out = copy_gguf(FIXTURES / "qwen2_moe.gguf", tmp_path / "shexp-1d.gguf", tensor=squeeze)
    assert len(squeezed) == 2
    src = open_weights(out)
    assert src.gguf_names() and tuple(src._tensors["blk.0.ffn_gate_inp_shexp.weight"].shape) == (64,)
    src.validate()
    assert src.shape("model.layers.0.mlp.shared_expert_gate.weight") == (1, 64)
    ref = reference("qwen2_moe")
    got = logits(build_model(src), ref["token_ids"])
    assert rel_err(got, np.array(ref["hf_logits"], dtype=np.float32)) <= 1e-4
