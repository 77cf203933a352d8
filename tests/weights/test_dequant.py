"""Torch dequantizers vs gguf-py (the reference llama.cpp itself agrees with, bit for bit)."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

from ktransformers.weights import dequant as dq
from ktransformers.weights.dequant import TORCH_DEQUANT_TYPES
from ktransformers.weights.ggml_types import TYPES, ggml_type_info

from ._util import QUANTS, TINY, fixture_dir

# byte offsets of the fp16 scale fields per type (everything else may be any byte)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def random_blocks(name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks: random bytes with finite, sane fp16 scales (and finite plain floats)."""
    info = ggml_type_info(name)
    rng = np.random.default_rng(seed)
    if name == "F32":
        return rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    if name == "F16":
        return rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if name == "BF16":
        bits = (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8).reshape(n_blocks, 2)
    b = rng.integers(0, 256, size=(n_blocks, info.block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        scale = (rng.uniform(-0.05, 0.05, n_blocks)).astype(np.float16)
        b[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return b


def reference(blocks: np.ndarray, name: str) -> np.ndarray:
    qt = gguf.GGMLQuantizationType[name]
    if name == "F32":
        return blocks.reshape(-1).view(np.float32)
    return gguf.quants.dequantize(blocks.reshape(-1), qt).reshape(-1)


def test_table_matches_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES

    for qt, (be, bb) in GGML_QUANT_SIZES.items():
        info = TYPES[int(qt)]
        assert (info.name, info.block_elems, info.block_bytes) == (qt.name, be, bb)
    assert set(TORCH_DEQUANT_TYPES) >= {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                  "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_random_blocks_bit_exact(name):
    blocks = random_blocks(name, 777, seed=hash(name) % 1000)
    ref = reference(blocks, name)
    # small chunk so the chunk loop and the tail are exercised
    got = dq.dequantize(blocks.reshape(-1), name, chunk_blocks=100).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    # reduced precisions are the float32 result rounded once
    for dt in (torch.bfloat16, torch.float16):
        low = dq.dequantize(blocks.reshape(-1), name, dtype=dt, chunk_blocks=64)
        assert low.dtype == dt
        assert torch.equal(low, torch.from_numpy(ref.astype(np.float32)).to(dt))


def test_shape_and_zero_copy_f32():
    x = np.arange(12, dtype=np.float32)
    t = dq.dequantize(x.view(np.uint8), "F32", shape=(3, 4))
    assert t.shape == (3, 4) and t.data_ptr() == x.ctypes.data
    with pytest.raises(ValueError):
        dq.dequantize(x.view(np.uint8), "F32", shape=(5, 4))
    with pytest.raises(ValueError):
        dq.dequantize(np.zeros(35, np.uint8), "Q8_0")


def test_fallback_type_warns_once_and_matches():
    # TQ2_0 has no torch dequantizer here: gguf-py's numpy one is used with a one-time warning
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(8, 66), dtype=np.uint8)
    blocks[:, 64:66] = np.full(8, 0.01, np.float16).view(np.uint8).reshape(8, 2)
    dq._warned_fallback.discard("TQ2_0")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = dq.dequantize(blocks.reshape(-1), "TQ2_0", chunk_blocks=3)
        dq.dequantize(blocks.reshape(-1), "TQ2_0")
    assert sum("TQ2_0" in str(x.message) for x in w) == 1
    ref = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType.TQ2_0)
    np.testing.assert_array_equal(a.numpy(), ref.reshape(-1))


def test_unsupported_type():
    with pytest.raises(dq.UnsupportedTypeError):
        dq.dequantize(np.zeros(40, np.uint8), "Q8_1")


@pytest.mark.parametrize("model", TINY)
@pytest.mark.parametrize("quant", QUANTS)
def test_every_fixture_tensor_bit_exact(model, quant):
    reader = gguf.GGUFReader(fixture_dir(model) / f"{quant}.gguf")
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float32)
        got = dq.dequantize(np.asarray(t.data).reshape(-1).view(np.uint8), int(t.tensor_type)).numpy()
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (model, quant, t.name)
