"""IQ4_NL / IQ4_XS: our C++ quantizers against gguf-py's dequantizer and llama-quantize's error; the
IQ4 presets' per-tensor types; an IQ4_XS file written by the converter loads and generates.

Measured (``tests/fixtures/llamacpp/iq4_reference.json``, same F32 tensors, RMS error of ours / of
llama-quantize's, all tensors of a type together): IQ4_XS 1.000015 (qwen3moe-tiny) / 0.999998
(deepseek2-tiny), IQ4_NL 1.000000 on both (deepseek2's 128-wide rows in the IQ4_XS file included);
the K-quant and Q8_0 tensors of those files 1.0000.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ktransformers.convert import PresetPolicy, arch_of, convert, fit_type
from ktransformers.weights.dequant import dequantize
from ktransformers.weights.quantize import native_quantizer, quantize

from ._util import fixture_dir

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("llama_quant_reference", ROOT / "tests" / "llama_quant_reference.py")
ref_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref_mod)

LLAMA_CPP = Path(os.environ.get("KT_LLAMA_CPP_DIR", "/nonexistent"))
#: our RMS error may exceed llama-quantize's on the same tensors by at most this factor
ERR_RATIO = 1.02

needs_native = pytest.mark.skipif(native_quantizer() is None or not native_quantizer().quantize_rows_supported(23),
                                  reason="extension built without the C++ IQ4 quantizer")


@needs_native
@pytest.mark.parametrize("name,bound", [("IQ4_NL", 0.085), ("IQ4_XS", 0.085)])
def test_iq4_equals_gguf_py_dequant_and_round_trips(name, bound):
    torch.manual_seed(0)
    w = torch.randn(8, 512)
    w[3] = 0.0  # an all-zero row: zero scales, no NaN
    w[5, :256] = 1e-20  # below the group epsilon
    w[6] *= torch.linspace(0.01, 10, 512)  # sub-blocks of very different scale
    q = quantize(w, name)
    assert q.nbytes == 8 * 512 // (32 if name == "IQ4_NL" else 256) * (18 if name == "IQ4_NL" else 136)
    ours = dequantize(q, name, w.shape)
    theirs = gguf.quants.dequantize(q.reshape(8, -1), gguf.GGMLQuantizationType[name]).reshape(8, 512)
    assert np.array_equal(ours.numpy(), theirs)
    assert torch.isfinite(ours).all() and (ours[3] == 0).all() and ours[5, :256].abs().max() < 1e-6
    rows = [0, 1, 2, 4, 7]
    rel = ((ours[rows] - w[rows]).norm() / w[rows].norm()).item()
    assert rel < bound, rel


@needs_native
def test_iq4_threads_give_the_same_bytes():
    torch.manual_seed(1)
    w = torch.randn(64, 1024)
    os.environ["KT_QUANT_THREADS"] = "1"
    try:
        one = quantize(w, "IQ4_XS")
    finally:
        del os.environ["KT_QUANT_THREADS"]
    assert np.array_equal(one, quantize(w, "IQ4_XS"))


def _reference(model: str, preset: str, f32: Path, tmp: Path) -> dict[str, list]:
    """{tensor: [type, squared error]} of llama-quantize: run it where KT_LLAMA_CPP_DIR has a build,
    else the committed numbers."""
    if ref_mod.quantize_bin(LLAMA_CPP) is not None:
        q = ref_mod.llama_quantize(LLAMA_CPP, f32, preset, tmp / f"{model}-{preset}.gguf")
        return ref_mod.tensor_errors(f32, q)
    return json.loads(ref_mod.REFERENCE.read_text())["models"][model][preset]


@pytest.fixture(scope="module")
def f32_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("iq4")
    return tmp, {m: ref_mod.write_f32(fixture_dir(m) / "hf", tmp / f"{m}-F32.gguf") for m in ref_mod.MODELS}


@needs_native
@pytest.mark.parametrize("model", ref_mod.MODELS)
@pytest.mark.parametrize("preset", ref_mod.PRESETS)
def test_iq4_presets_match_llama_quantize(f32_files, model, preset):
    """Same per-tensor types as llama-quantize's file of the preset; per type, our round-trip RMS
    error on the same F32 tensors is within ERR_RATIO of llama-quantize's."""
    from transformers import AutoConfig

    tmp, files = f32_files
    want = _reference(model, preset, files[model], tmp)
    cfg = AutoConfig.from_pretrained(fixture_dir(model) / "hf")
    policy = PresetPolicy.for_config(preset, cfg, arch_of(cfg))
    f32 = {t.name: t for t in gguf.GGUFReader(str(files[model])).tensors}
    got_types = {name: policy.choose(name, tuple(int(s) for s in f32[name].data.shape)) for name in want}
    assert got_types == {name: t for name, (t, _) in want.items()}
    err: dict[str, list[float]] = {}
    for name, (t, theirs) in want.items():
        if t in ("F32", "F16"):
            continue
        x = np.array(f32[name].data, dtype=np.float32)
        y = gguf.quants.dequantize(quantize(x, t).reshape(*x.shape[:-1], -1), gguf.GGMLQuantizationType[t])
        e = err.setdefault(t, [0.0, 0.0])
        e[0] += float(((y.astype(np.float64) - x) ** 2).sum())
        e[1] += theirs
    assert "IQ4_NL" in err or "IQ4_XS" in err
    for t, (ours, theirs) in err.items():
        print(model, preset, t, f"RMS error ours / llama-quantize's: {(ours / theirs) ** 0.5:.6f}")
        assert (ours / theirs) ** 0.5 < ERR_RATIO, (t, (ours / theirs) ** 0.5)


def test_iq4_fallbacks():
    assert fit_type("IQ4_XS", 4096) == "IQ4_XS"
    assert fit_type("IQ4_XS", 128) == "IQ4_NL"
    assert fit_type("IQ4_NL", 96) == "IQ4_NL"
    assert fit_type("IQ4_NL", 48) == "F16"
    p = PresetPolicy("IQ4_XS", n_layer=16, n_gqa=4)
    assert p.choose("blk.0.attn_v.weight", (256, 1024)) == "Q5_K"  # 4 query heads per KV head
    assert p.choose("blk.1.ffn_down.weight", (1024, 2048)) == "Q5_K"  # first eighth of the layers
    assert p.choose("blk.2.ffn_down.weight", (1024, 2048)) == "IQ4_XS"
    assert p.choose("output.weight", (4096, 1024)) == "Q6_K"
    assert PresetPolicy("IQ4_NL", n_layer=16, n_gqa=2).choose("blk.0.attn_v.weight", (256, 1024)) == "IQ4_NL"


@needs_native
def test_iq4_xs_file_loads_and_generates(tmp_path, tiny_model_dir):
    """A converter IQ4_XS file (IQ4_XS, IQ4_NL fallbacks, Q5_K, Q6_K tensors) through load_model:
    logits near the HF model's, and greedy generation runs."""
    import ktransformers
    from transformers import AutoModelForCausalLM

    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path / "hf"
    write_tiny_model("llama", d, seed=3, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=1)
    out = convert(d, tmp_path / "iq4xs.gguf", preset="IQ4_XS")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.1.ffn_gate.weight"] == "IQ4_XS" and types["blk.0.attn_v.weight"] == "Q5_K"
    assert types["output.weight"] == "Q6_K"
    assert gguf.GGUFReader(str(out)).fields["general.file_type"].contents() == 30
    model = ktransformers.load_model(out, model_path=d)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ids = torch.tensor([[1, 17, 42, 99, 123, 7, 64, 200]])
    with torch.no_grad():
        got, want = model(ids).logits[0], ref(ids).logits[0]
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.3, rel  # measured 0.216 (the same model as Q4_K_M: 0.221, Q8_0: 0.024)
    gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 6)


def test_file_type_table_is_llama_cpp_s():
    """One table of general.file_type values, read by the converter and the server."""
    from ktransformers.convert import PRESETS
    from ktransformers.weights.ggml_types import FILE_TYPE_NAMES, FILE_TYPES

    assert (FILE_TYPES["F32"], FILE_TYPES["Q4_K_M"], FILE_TYPES["IQ4_NL"], FILE_TYPES["IQ4_XS"], FILE_TYPES["BF16"]) \
        == (0, 15, 25, 30, 32)
    assert set(PRESETS) <= set(FILE_TYPES) and FILE_TYPE_NAMES[30] == "IQ4_XS"
