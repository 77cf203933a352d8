"""Converter presets pick llama-quantize's per-tensor types; the C++ K-quant quantizer matches the
torch reference; a tokenizer goes into the file."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ktransformers.convert import PresetPolicy, arch_of, convert
from ktransformers.weights.dequant import dequantize
from ktransformers.weights.gguf_source import GGUFSource
from ktransformers.weights.quantize import native_quantizer, quantize

from ._util import fixture_dir


@pytest.mark.parametrize("model_name", ["qwen3moe-tiny", "deepseek2-tiny"])
@pytest.mark.parametrize("preset", ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0"])
def test_preset_types_equal_llama_quantize(model_name, preset):
    """Every tensor's type in llama-quantize's own file of that preset is the one we choose."""
    from transformers import AutoConfig

    d = fixture_dir(model_name)
    cfg = AutoConfig.from_pretrained(d / "hf")
    src = GGUFSource(d / f"{preset}.gguf")
    policy = PresetPolicy.for_config(preset, cfg, arch_of(cfg))
    got = {name: policy.choose(name, tuple(shape)) for name, _, shape, _ in src.tensor_info()}
    want = {name: t for name, t, _, _ in src.tensor_info()}
    assert got == want


def test_unwritable_preset_is_one_line():
    from ktransformers.errors import ConfigError

    with pytest.raises(ConfigError, match="IQ3_M: its types have no quantizer"):
        PresetPolicy("IQ3_M", n_layer=2)
    with pytest.raises(ConfigError, match="unknown preset"):
        PresetPolicy("Q9_K", n_layer=2)


needs_native = pytest.mark.skipif(native_quantizer() is None or not hasattr(native_quantizer(), "quantize_rows"),
                                  reason="extension built without the C++ quantizer")


@needs_native
@pytest.mark.parametrize("hf,qtype", [("model.layers.0.self_attn.q_proj.weight", "Q4_K"),
                                      ("model.layers.0.self_attn.o_proj.weight", "Q5_K"),
                                      ("model.layers.1.mlp.experts.down_proj", "Q6_K"),
                                      ("lm_head.weight", "Q6_K")])
def test_native_kquants_equal_llama_quantize_bytes(hf, qtype):
    """The C++ quantizer writes llama-quantize's bytes (same weights, its Q4_K_M file)."""
    from safetensors.torch import load_file

    d = fixture_dir("qwen3moe-tiny")
    src = GGUFSource(d / "Q4_K_M.gguf")
    raw = src.raw(hf)
    assert raw.ggml_type == {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}[qtype]
    if hf.endswith("experts.down_proj"):
        sd = load_file(d / "hf" / "model.safetensors")
        x = torch.stack([sd[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].float() for e in range(8)])
    else:
        x = load_file(d / "hf" / "model.safetensors")[hf].float()
    ours = quantize(x, qtype)
    theirs = np.asarray(raw.data).reshape(-1)
    assert ours.shape == theirs.shape
    bb = len(ours) // (x.numel() // 256)
    assert (ours.reshape(-1, bb) == theirs.reshape(-1, bb)).all(1).mean() >= 0.99


@needs_native
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_native_kquants_edge_rows(qtype):
    """Zero rows and rows below the group epsilon dequantize to (near) zero, no NaN."""
    torch.manual_seed(0)
    x = torch.randn(8, 512)
    x[3] = 0.0
    x[5, :256] = 1e-20
    y = dequantize(quantize(x, qtype), qtype, tuple(x.shape))
    assert torch.isfinite(y).all() and y[3].abs().max() == 0 and y[5, :256].abs().max() < 1e-6
    ref = dequantize(quantize(x, qtype, native=False), qtype, tuple(x.shape))
    assert (y - x).pow(2).mean() <= (ref - x).pow(2).mean() * 1.02


@needs_native
def test_native_quantizer_is_fast():
    x = torch.randn(512, 4096)
    t0 = time.perf_counter()
    quantize(x, "Q4_K")
    rate = x.numel() / (time.perf_counter() - t0)
    assert rate > 2e6, f"{rate / 1e6:.2f} M params/s"


def test_convert_writes_tokenizer_and_preset(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    d = tiny_model_dir("qwen3_moe")
    out = convert(d, tmp_path / "m.gguf", preset="Q8_0")
    src = GGUFSource(out)
    assert src.metadata["general.file_type"] == 7
    assert src.metadata["tokenizer.ggml.model"] == "gpt2"
    tok, ref = src.tokenizer(), AutoTokenizer.from_pretrained(d)
    text = "Hello <|im_start|>user\nwörld<|im_end|>"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.chat_template == ref.chat_template
    # the vocabulary llama.cpp's own converter writes for the same tokenizer (committed fixture)
    import gguf

    from ktransformers.weights.gguf_source import field_value

    lc = gguf.GGUFReader(str(__import__("pathlib").Path(__file__).resolve().parents[1]
                             / "fixtures" / "llamacpp" / "qwen3_moe.gguf"))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id"):
        assert field_value(lc.fields[key]) == src.metadata[key], key
