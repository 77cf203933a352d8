"""The low-bit IQ types (IQ1_S .. IQ3_S): torch dequantizers bit-exact with gguf-py, and GGUF files
holding them read through our reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ktransformers.weights import block_dequant as bd
from ktransformers.weights import dequant as dq
from ktransformers.weights.ggml_types import ggml_type_info

from gguf_files import finish, iq_blocks_with_scales

IQ_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


def random_iq_blocks(name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random index / sign / scale bits with a finite random fp16 block scale."""
    return iq_blocks_with_scales(name, n_blocks, np.random.default_rng(seed),
                                 lambda rng, n: rng.uniform(-0.05, 0.05, n))


def reference(blocks: np.ndarray, name: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType[name]).reshape(-1)


def test_sizes_from_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES

    for name in IQ_TYPES:
        info = ggml_type_info(name)
        assert (info.block_elems, info.block_bytes) == GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert name in dq.TORCH_DEQUANT_TYPES


@pytest.mark.parametrize("name", IQ_TYPES)
def test_random_blocks_bit_exact(name):
    blocks = random_iq_blocks(name, 513, seed=IQ_TYPES.index(name))
    ref = reference(blocks, name).astype(np.float32)
    assert np.isfinite(ref).all() and np.count_nonzero(ref) > ref.size // 2
    with _no_fallback():
        got = dq.dequantize(blocks.reshape(-1), name, chunk_blocks=100).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    low = dq.dequantize(blocks.reshape(-1), name, dtype=torch.bfloat16, chunk_blocks=64)
    assert torch.equal(low, torch.from_numpy(ref).to(torch.bfloat16))


@pytest.mark.parametrize("name", IQ_TYPES)
def test_every_index_and_sign_pattern(name):
    """Blocks whose index fields walk the whole code book (random blocks may miss entries)."""
    info = ggml_type_info(name)
    n = 2048 * 4 // 32 + 1  # IQ1_*: 2048 entries, 32 indices per block
    blocks = random_iq_blocks(name, n, seed=99)
    ramp = np.arange(n * info.block_bytes, dtype=np.uint64) * 2654435761 % 256
    keep = blocks.copy()
    blocks = ramp.astype(np.uint8).reshape(n, info.block_bytes)
    if name == "IQ1_M":
        blocks[:, 48:56] = (blocks[:, 48:56].view(np.uint16) & 0x0FFF | keep[:, 48:56].view(np.uint16) & 0xF000).view(np.uint8)
    else:
        blocks[:, 0:2] = keep[:, 0:2]
    ref = reference(blocks, name).astype(np.float32)
    got = dq.dequantize(blocks.reshape(-1), name).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_tables_come_from_gguf_py():
    assert bd.iq_grid("IQ2_XXS").shape == (256, 8)
    assert bd.iq_grid("IQ1_S").shape == (2048, 8)
    assert set(np.unique(bd.iq_grid("IQ1_S"))) == {-1.0, 0.0, 1.0}
    ks = bd.iq_ksigns()
    assert ks.shape == (128,)
    # ksigns: bit 7 makes the parity of the 8 sign bits even
    assert all(bin(int(v)).count("1") % 2 == 0 for v in ks)


def test_gguf_file_round_trip(tmp_path):
    """A GGUF written by gguf-py with IQ tensors loads through GGUFSource: shapes, types, values."""
    from ktransformers.weights.gguf_source import GGUFSource

    p = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(p), arch="qwen3moe")
    w.add_block_count(1)
    w.add_head_count(4)
    w.add_embedding_length(512)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    data = {}
    for i, name in enumerate(IQ_TYPES):
        # 2-D matrices, and a stack of routed experts in the type unsloth's files use most
        shape = (4, 64, 512) if name == "IQ2_XXS" else (3 + i, 512)
        tname = "blk.0.ffn_gate_exps.weight" if name == "IQ2_XXS" else f"blk.0.test_{name.lower()}.weight"
        blocks = random_iq_blocks(name, int(np.prod(shape)) // 256, seed=10 + i)
        data[tname] = (name, shape, blocks)
        w.add_tensor(tname, blocks.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[name])
    finish(w)
    src = GGUFSource(p)
    info = {n: (t, tuple(s)) for n, t, s, _ in src.tensor_info()}
    for tname, (name, shape, blocks) in data.items():
        assert info[tname] == (name, shape)
        raw = src.raw(tname)
        assert raw.type.name == name and tuple(raw.shape) == shape
        assert np.array_equal(np.asarray(raw.data).reshape(-1), blocks.reshape(-1))
        got = dq.dequantize(raw.data, raw.type, shape=raw.shape)
        ref = reference(blocks, name).reshape(shape)
        assert got.shape == shape
        np.testing.assert_array_equal(got.numpy(), ref)


class _no_fallback:
    """Fail if the gguf-py numpy fallback is used (it warns once per type)."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", RuntimeWarning)
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
