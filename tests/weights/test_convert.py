"""Our quantizers and the HF -> GGUF converter.

Quantizer quality vs llama-quantize (same HF fp32 weights, RMS error of our bytes / of llama.cpp's
bytes in the fixture GGUFs, measured): Q6_K 1.000, Q5_K 1.003, Q4_K 1.006 (byte-identical blocks:
99.9 % / 88 % / 86 %).  Converter round trip, tiny HF -> GGUF -> GGUFSource -> HF fp32 logits vs
``hf_logits.npy`` (measured max abs / mean abs):

=============  ==================  ==================
file           qwen3moe-tiny       deepseek2-tiny
=============  ==================  ==================
F32            1.6e-05 / 1.0e-06   5.0e-06 / 8.6e-07
Q8_0           0.180 / 0.019       0.093 / 0.018
Q6_K           0.443 / 0.061       0.302 / 0.048
Q4_K           2.61 / 0.273        2.74 / 0.317
=============  ==================  ==================

(The quantized rows equal what llama.cpp's own files of that type give: see the fixtures README,
"HF-on-dequantized GGUF vs HF fp32" 0.179 / 0.573 / 3.11 for Q8_0 / Q6_K / Q4_K_M on qwen3moe.)
"""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ktransformers.convert import convert, fit_type
from ktransformers.weights.dequant import dequantize
from ktransformers.weights.gguf_source import GGUFSource
from ktransformers.weights.quantize import quantize

from ._util import fixture_dir, load_npy, tiny_tokens
from .test_gguf_source import build_model, logits

TOL = {  # max abs, mean abs vs HF fp32 (measured values above, with headroom)
    "F32": (1e-4, 1e-5),
    "Q8_0": (0.3, 0.03),
    "Q6_K": (0.7, 0.09),
    "Q4_K": (4.0, 0.45),
}


def _hf_weight(sd, hf, shape):
    if hf.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")):
        base, proj = hf.rsplit(".", 1)
        return torch.stack([sd[f"{base}.{e}.{proj}.weight"].float() for e in range(shape[0])])
    return sd[hf].float()


def test_kquant_quality_vs_llama_quantize():
    """Q4_K_M holds Q4_K, Q5_K and Q6_K tensors of the same HF weights."""
    d = fixture_dir("qwen3moe-tiny")
    sd = load_file(d / "hf" / "model.safetensors")
    for qfile in ("Q4_K_M",):
        src = GGUFSource(d / f"{qfile}.gguf")
        err = {}
        for g, tname, shape, hf in src.tensor_info():
            if tname not in ("Q4_K", "Q5_K", "Q6_K") or not hf:
                continue
            w = _hf_weight(sd, hf, shape)
            ours = dequantize(quantize(w, tname), tname, w.shape)
            theirs = dequantize(src.raw(hf).data, tname, w.shape)
            e = err.setdefault(tname, [0.0, 0.0])
            e[0] += ((ours - w) ** 2).sum().item()
            e[1] += ((theirs - w) ** 2).sum().item()
        assert err
        for tname, (ours, theirs) in err.items():
            assert (ours / theirs) ** 0.5 < 1.02, (qfile, tname, (ours / theirs) ** 0.5)


def test_q8_0_bytes_identical_to_llama_quantize():
    d = fixture_dir("qwen3moe-tiny")
    sd = load_file(d / "hf" / "model.safetensors")
    src = GGUFSource(d / "Q8_0.gguf")
    n = 0
    for g, tname, shape, hf in src.tensor_info():
        if tname == "Q8_0" and hf:
            w = _hf_weight(sd, hf, shape)
            assert np.array_equal(quantize(w, "Q8_0"), src.raw(hf).data), g
            n += 1
    assert n >= 10


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "BF16"])
def test_quantize_round_trip_and_gguf_py_reads_it(name):
    torch.manual_seed(0)
    w = torch.randn(8, 512)
    w[3] = 0.0  # an all-zero row must not produce NaNs
    q = quantize(w, name)
    back = dequantize(q, name, w.shape)
    ref = gguf.quants.dequantize(q.reshape(8, -1), gguf.GGMLQuantizationType[name])
    assert np.array_equal(back.numpy(), ref.reshape(8, 512))
    rel = ((back - w).norm() / w.norm()).item()
    bound = {"Q2_K": 0.35, "Q3_K": 0.18, "Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.022, "Q4_0": 0.11,
             "Q5_0": 0.055, "Q5_1": 0.05, "Q8_0": 0.007, "BF16": 0.003}[name]
    assert rel < bound, rel
    assert torch.isfinite(back).all() and (back[3] == 0).all()


def test_fallback_types():
    assert fit_type("Q4_K", 4096) == "Q4_K"
    assert fit_type("Q4_K", 128) == "Q5_0"
    assert fit_type("Q5_K", 96) == "Q5_1"
    assert fit_type("Q6_K", 64) == "Q8_0"
    assert fit_type("Q8_0", 48) == "F16"


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_name,qtype",
    [("qwen3moe-tiny", "F32"), ("qwen3moe-tiny", "Q8_0"), ("qwen3moe-tiny", "Q4_K"),
     ("deepseek2-tiny", "F32"), ("deepseek2-tiny", "Q8_0"), ("deepseek2-tiny", "Q6_K"), ("deepseek2-tiny", "Q4_K")],
)
def test_convert_round_trip_logits(tmp_path, model_name, qtype):
    d = fixture_dir(model_name)
    out = convert(d / "hf", tmp_path / f"{qtype}.gguf", qtype, qtype, qtype)
    src = GGUFSource(out)
    src.validate()
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == src.arch
    lg = logits(build_model(src), tiny_tokens(model_name))
    ref = load_npy(model_name, "hf_logits.npy")
    mx, mean = TOL[qtype]
    diff = np.abs(lg - ref)
    assert diff.max() <= mx and diff.mean() <= mean, (diff.max(), diff.mean())
    if qtype == "Q8_0":
        # same bytes as llama.cpp's own Q8_0 file wherever both chose Q8_0
        theirs = GGUFSource(d / "Q8_0.gguf")
        for g, tname, shape, hf in theirs.tensor_info():
            if tname == "Q8_0" and src.ggml_type(g) == gguf.GGMLQuantizationType.Q8_0:
                assert np.array_equal(src.raw(g).data, theirs.raw(g).data), g


def test_cli(tmp_path):
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1")
    d = fixture_dir("deepseek2-tiny")
    out = tmp_path / "cli.gguf"
    r = subprocess.run([sys.executable, "-m", "ktransformers.convert", "--model_path", str(d / "hf"), "--output",
                        str(out), "--experts", "Q4_K", "--attention", "Q8_0", "--default", "Q6_K", "-q"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    src = GGUFSource(out)
    types = {g: t for g, t, _, _ in src.tensor_info()}
    assert types["blk.1.ffn_gate_exps.weight"] == "Q4_K"
    assert types["blk.1.attn_q_b.weight"] == "Q8_0"  # 128-wide rows: no K-quant needed for Q8_0
    assert types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["blk.1.ffn_gate_inp.weight"] == "F32" and types["output_norm.weight"] == "F32"
    assert type(src.config()).__name__ == "DeepseekV3Config"
    bad = subprocess.run([sys.executable, "-m", "ktransformers.convert", "--model_path", str(tmp_path),
                          "--output", str(tmp_path / "x.gguf")], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1
