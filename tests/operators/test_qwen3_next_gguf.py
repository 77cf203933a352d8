"""Qwen3-Next from GGUF: llama.cpp's ``qwen3next`` names and metadata (gated DeltaNet as ``ssm_*``,
``in_proj_qkvz`` split into ``attn_qkv`` + ``attn_gate``, ``ssm_a = -exp(A_log)``, norms stored
``w + 1`` except ``ssm_norm``, the gated shared expert as ``ffn_*_shexp`` / ``ffn_gate_inp_shexp``),
read by the source and written by the converter.

``tests/fixtures/llamacpp/qwen3_next.gguf`` (llama.cpp's converter, F32; its HF logits are checked in
tests/weights/test_llamacpp_fixtures.py) is the reference for what our converter writes.  With
``KT_LLAMA_CPP_DIR`` set, llama.cpp's converter also writes an F16 file here to compare types with.
Measured on the tiny model (max |Δ| relative to max |logit|, shipped Qwen3Next-cpu rules):

=====================  ===============================================================
file                   logits
=====================  ===============================================================
F32 (ours)             1.7e-6 vs transformers on the safetensors
F16 (ours)             2.4e-6 vs transformers on the dequantized file (4.5e-3 vs the
                       fp32 weights: the random DeltaNet layer amplifies F16 rounding)
Q8_0 (ours)            vs transformers on the dequantized file: mean |Δ| 0.048, median
                       per-position max 0.11, max 0.62 (1.9e-1): the kernels quantize
                       activations to 8 bits, amplified by the same layer
Q4_K_M preset (ours)   the same measure: 0.037, 0.074, 0.55 (in_proj_qkvz dequantized:
                       its two halves have different types)
=====================  ===============================================================
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ktransformers import load_model
from ktransformers.convert import convert
from ktransformers.util.tiny_models import write_tiny_model
from ktransformers.weights.dequant import dequantize
from ktransformers.weights.gguf_source import GGUFSource

from gguf_files import copy_gguf

from .family_checks import (assert_converter_rewrites, assert_f16_as_llama_cpps, hf_on_gguf, our_f32_file, prompt_ids,
                            rel_err)

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "llamacpp" / "qwen3_next.gguf"
LLAMA_CPP = Path(os.environ.get("KT_LLAMA_CPP_DIR", "/nonexistent"))  # a llama.cpp source tree
ARCH = "qwen3_next"
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
               "rope_parameters", "layer_types", "mlp_only_layers", "linear_conv_kernel_dim",
               "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "intermediate_size", "norm_topk_prob", "vocab_size", "tie_word_embeddings")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # hf: the shared fixture (conftest.py)


#: the model key only our converter writes
OURS_ONLY = ("qwen3next.vocab_size",)


def test_converter_writes_llama_cpps_file(tmp_path):
    """llama.cpp's file read back and converted by ours: the same file (family_checks)."""
    model = assert_converter_rewrites(FIXTURE, tmp_path, OURS_ONLY)
    assert model.config.mlp_only_layers == [] and model.config.layer_types[0] == "linear_attention"


def test_config_from_metadata_and_f32_logits(tiny_model_dir, hf, tmp_path):
    """Our F32 file of the tiny model (a dense-MLP layer included): the config comes back from the
    metadata alone and the shipped rules give transformers' logits."""
    f32, _ = our_f32_file(tiny_model_dir(ARCH), hf, tmp_path, CONFIG_KEYS)
    ids = prompt_ids()
    model = load_model(f32, allow_unmatched=False)
    assert type(model.model.layers[0].linear_attn).__name__ == "Qwen3NextGatedDeltaNet"
    assert model.model.layers[0].linear_attn.in_proj_qkvz.generate_op.name == "KLinearCPU"
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) <= 1e-4


def test_f16_and_q8_0_through_the_shipped_rules(tiny_model_dir, tmp_path):
    """F16 and Q8_0 weights read in place by the CPU kernels (in_proj_qkvz as reordered whole rows of
    attn_qkv + attn_gate) against transformers on the same dequantized weights (bars: module docstring)."""
    d = tiny_model_dir(ARCH)
    ids = prompt_ids()
    for qtype in ("F16", "Q8_0"):
        path = convert(d, tmp_path / f"{qtype}.gguf", qtype, qtype, qtype)
        src = GGUFSource(path)
        name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
        raw = src.raw(name)
        assert raw.type.name == qtype
        assert torch.equal(dequantize(raw.data, raw.type, raw.shape), src.tensor(name))
        with torch.no_grad():
            got = load_model(path, allow_unmatched=False)(ids).logits
            ref = hf_on_gguf(src)(ids).logits
        if qtype == "F16":
            assert rel_err(got, ref) <= 1e-4
        else:
            dev = (got - ref).abs()[0]
            assert dev.mean() <= 0.08 and dev.max(1).values.median() <= 0.2 and dev.max() <= 0.75


def test_halves_of_different_types(tiny_model_dir, tmp_path):
    """llama-quantize's K-quant presets give ``attn_qkv`` more bits than ``attn_gate``: no stored
    bytes serve ``in_proj_qkvz`` then, and the kernels get it dequantized (same bars as Q8_0)."""
    path = convert(tiny_model_dir(ARCH), tmp_path / "q4km.gguf", preset="Q4_K_M")
    src = GGUFSource(path)
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_qkv.weight"] != types["blk.0.attn_gate.weight"]
    assert src.raw(name) is None and src.ggml_type(name) is None
    ids = prompt_ids()
    with torch.no_grad():
        dev = (load_model(path, allow_unmatched=False)(ids).logits - hf_on_gguf(src)(ids).logits).abs()[0]
    assert dev.mean() <= 0.08 and dev.max(1).values.median() <= 0.2 and dev.max() <= 0.75


def _rewrite(out: Path, keys: dict | None = None, drop: tuple[str, ...] = (), add: dict | None = None) -> Path:
    """The fixture with metadata ``keys`` replaced or added (u32 / bool arrays), tensors ``drop`` left
    out and ``add`` appended."""
    return copy_gguf(FIXTURE, out, keys=keys, tensor=lambda n, data, qt: None if n in drop else (data, qt), add=add)


def test_missing_gate_half_is_named(tmp_path):
    """A file with ``attn_qkv`` but not its ``attn_gate``: one error naming both tensors."""
    from ktransformers.errors import WeightError

    out = _rewrite(tmp_path / "no-gate.gguf", drop=("blk.0.attn_gate.weight",))
    with pytest.raises(WeightError, match=r"'blk\.0\.attn_qkv\.weight' has no 'blk\.0\.attn_gate\.weight'"):
        GGUFSource(out)


def test_file_with_the_mtp_layer(tmp_path):
    """llama.cpp's default conversion keeps the MTP block as one more layer (``nextn_predict_layers``,
    ``recurrent_layers`` one longer, ``blk.N.nextn.*``): the model is built without it, same logits."""
    import json

    reader = gguf.GGUFReader(FIXTURE)
    add = {f"blk.3.{t.name.split('.', 2)[2]}": np.array(t.data) for t in reader.tensors if t.name.startswith("blk.2.")}
    add["blk.3.nextn.eh_proj.weight"] = np.ones((64, 128), np.float32)
    for n in ("enorm", "hnorm", "shared_head_norm"):
        add[f"blk.3.nextn.{n}.weight"] = np.ones(64, np.float32)
    out = _rewrite(tmp_path / "mtp.gguf", add=add, keys={
        "qwen3next.block_count": 4, "qwen3next.nextn_predict_layers": 1,
        "qwen3next.attention.recurrent_layers": [True, False, False, False]})
    src = GGUFSource(out)
    src.validate()
    cfg = src.config()
    assert cfg.num_hidden_layers == 3 and cfg.layer_types == ["linear_attention", "full_attention", "full_attention"]
    ref = json.loads(FIXTURE.with_suffix(".json").read_text())
    model = load_model(out, allow_unmatched=False)
    with torch.no_grad():
        got = model(torch.tensor([ref["token_ids"]])).logits[0]
    assert rel_err(got, torch.tensor(ref["hf_logits"])) <= 1e-4
    # the block is not read as a drafter: one line says so and where the layer is read from
    from ktransformers.errors import ConfigError
    from ktransformers.generation import Generator
    from tests.generation.test_invariance import _NoText

    with pytest.raises(ConfigError, match=r"^--speculative mtp: qwen3_next from a GGUF: .*blk\.3\.nextn.*safetensors"):
        Generator(model, _NoText(), speculative="mtp")


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"llama.cpp's converter not found at {LLAMA_CPP} (set KT_LLAMA_CPP_DIR)")
def test_same_file_as_llama_cpp_converter_f16(tmp_path):
    """llama.cpp's converter and ours on one tiny model at F16: the same tensors, types (F32 norms,
    router, shared-expert gate, ssm_conv1d, ssm_a, ssm_dt) and metadata; its file loads through the
    shipped rules with transformers' logits on its dequantized weights."""
    d = tmp_path / "hf"
    write_tiny_model(ARCH, d, seed=0, mlp_only_layers=[])  # llama.cpp's qwen3next has no dense-MLP layers
    assert_f16_as_llama_cpps(LLAMA_CPP, d, tmp_path, OURS_ONLY)
