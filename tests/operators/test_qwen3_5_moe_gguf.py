"""Qwen3.5-MoE from GGUF: llama.cpp's ``qwen35moe`` (the DeltaNet projections apart as ``attn_qkv``,
``attn_gate``, ``ssm_alpha``, ``ssm_beta``; V heads stored tiled across key heads, where HF groups
them per key head; ``ssm_a = -exp(A_log)``, norms ``w + 1`` but ``ssm_norm``; MRoPE sections),
read by the source and written by the converter.

``tests/fixtures/llamacpp/qwen3_5_moe_text.gguf`` (llama.cpp's converter, F32; its HF logits are
checked in tests/weights/test_llamacpp_fixtures.py) is the reference for what our converter writes.
With ``KT_LLAMA_CPP_DIR`` set, llama.cpp's converter also writes an F16 file here to compare with.
Measured on the tiny model (2 key heads, 4 value heads; max |Δ| relative to max |logit|):
llama.cpp's F32 file 4.3e-7 through the reader, 2.2e-6 through the shipped Qwen3_5Moe-cpu rules;
our F32 file vs transformers on the safetensors: see tests/generation/test_families.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ktransformers.util.tiny_models import write_tiny_model
from ktransformers.weights import gguf_names as gn
from ktransformers.weights.gguf_source import GGUFSource

from .family_checks import assert_converter_rewrites, assert_f16_as_llama_cpps

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "llamacpp" / "qwen3_5_moe_text.gguf"
LLAMA_CPP = Path(os.environ.get("KT_LLAMA_CPP_DIR", "/nonexistent"))  # a llama.cpp source tree
ARCH = "qwen3_5_moe_text"
#: the model key only our converter writes
OURS_ONLY = ("qwen35moe.vocab_size",)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_converter_writes_llama_cpps_file(tmp_path):
    """llama.cpp's file read back and converted by ours: the same file (family_checks), V heads
    reordered the same way."""
    model = assert_converter_rewrites(FIXTURE, tmp_path, OURS_ONLY)
    assert model.config.linear_num_key_heads != model.config.linear_num_value_heads


def test_v_head_order_is_llama_cpps():
    """Our inverse of llama.cpp's ``_LinearAttentionVReorderBase._reorder_v_heads`` (grouped -> tiled):
    V head ``v`` of key head ``k`` is stored at ``v * n_k + k``; q and k channels stay in place."""
    nk, dk, nv, dv = 2, 3, 6, 2
    orders = gn.v_head_orders(nk, dk, nv, dv)
    dim, idx = orders["linear_attn.in_proj_qkv.weight"]
    assert dim == 0 and idx[:2 * nk * dk].tolist() == list(range(2 * nk * dk))
    _, heads = orders["linear_attn.A_log"]
    r = nv // nk
    assert heads.tolist() == [v * nk + k for k in range(nk) for v in range(r)]
    assert orders["linear_attn.out_proj.weight"][0] == 1
    assert gn.v_head_orders(2, dk, 2, dv) == {}


def test_raw_bytes_reordered_rows_and_computed_columns():
    """Reordered rows are served to the kernels as stored bytes (whole rows moved); ``ssm_out``'s
    reordered columns are computed, so no stored bytes serve it."""
    src = GGUFSource(FIXTURE)
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_z.weight"):
        raw = src.raw(name)
        assert raw is not None and tuple(raw.shape) == tuple(src.shape(name))
        assert torch.equal(torch.from_numpy(raw.data.view("float32").copy()).reshape(raw.shape), src.tensor(name))
        assert not np.array_equal(raw.data, src._tensors[src.gguf_name(name)].data)  # V rows moved
    assert src.raw("model.layers.0.linear_attn.out_proj.weight") is None
    assert src.ggml_type("model.layers.0.linear_attn.out_proj.weight") is None


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"llama.cpp's converter not found at {LLAMA_CPP} (set KT_LLAMA_CPP_DIR)")
def test_same_file_as_llama_cpp_converter_f16(tmp_path):
    """llama.cpp's converter and ours on one tiny model at F16: the same tensors, types and metadata;
    its file loads through the shipped rules with transformers' logits on its dequantized weights."""
    d = tmp_path / "hf"
    write_tiny_model(ARCH, d, seed=0)
    assert_f16_as_llama_cpps(LLAMA_CPP, d, tmp_path, OURS_ONLY)
