"""The low-bit IQ types on the CPU kernels: the C++ row dequantizer, the per-tier kernel table,
Linear / LinearGroup / MoE kernels against torch, and the generated code-book file.

Tolerances (||y - ref|| / ||ref||, ref = float64 dequantized weight @ x):
  * the baseline tier's generic path (row dequantized to fp32, fp32 dot)        1e-4
  * the integer kernels (activations quantized to int8 per 256, Q8_K-like)      2e-2
  * the MoE layer (three projections, the hidden state quantized twice)         3e-2
The test re-runs itself under KT_ISA=scalar (the generic path) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import QUICK, int_kernel_suffix
from gguf_files import finish, iq_blocks_with_scales
from ref import rel_err

import ktransformers.cpuinfer_ext as ext
import ktransformers.kernels as K
from ktransformers.weights import dequant as dq
from ktransformers.weights.ggml_types import ggml_type_info

ROOT = Path(__file__).resolve().parents[2]
IQ_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


def iq_blocks(name: str, n_blocks: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """Random index / sign / scale bits with a positive fp16 block scale about scale / 40."""
    return iq_blocks_with_scales(name, n_blocks, rng, lambda r, n: r.uniform(0.5, 1.5, n) * scale / 40)


def iq_weights(name: str, shape, rng):
    """(raw bytes shape[:-1] + (row_bytes,), float32 dequantized by gguf-py, shape)."""
    *lead, cols = shape
    raw = iq_blocks(name, int(np.prod(shape)) // 256, rng).reshape(*lead, -1)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).astype(np.float32).reshape(shape)
    return np.ascontiguousarray(raw), deq


def decode_kernel(name: str) -> str:
    return ext.kernel_rows()[name][0]


def tol(name: str) -> float:
    return 1e-4 if decode_kernel(name) == "generic" else 2e-2


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


def test_code_book_file_is_gguf_py_s():
    """csrc/iq_grids.cpp is what scripts/gen_iq_grids.py makes from the installed gguf-py."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_iq_grids.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_kernel_table_rows():
    rows = ext.kernel_rows()
    tier = K.isa_tier()
    for name in IQ_TYPES:
        assert ggml_type_info(name).kernel, name
        assert name in K.TYPES
        decode, prefill, act = rows[name]
        if tier == "scalar":
            assert (decode, prefill, act) == ("generic", "generic", "f32"), (name, rows[name])
        else:  # every tier with AVX2 runs the 256-bit integer kernels
            k = name.lower() + int_kernel_suffix(tier)
            if tier == "amx" and prefill.startswith("amx_bf16_dq"):  # tiles from a token count
                prefill = prefill.split("else ")[1].rstrip(")")
            assert (decode, prefill, act) == (k, f"{k}_t8", "q8_256"), rows[name]


@pytest.mark.parametrize("name", IQ_TYPES)
def test_cpp_dequantize_equals_torch(name):
    """The dispatched C++ row dequantizer gives the torch dequantizer's floats, bit for bit."""
    rng = np.random.default_rng(IQ_TYPES.index(name))
    raw = iq_blocks(name, 37, rng, scale=4.0)
    want = dq.dequantize(raw.reshape(-1), name).numpy()
    got = np.full(37 * 256, np.nan, np.float32)
    ext.dequantize(ggml_type_info(name).id, raw.ctypes.data, got.size, got.ctypes.data)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


SHAPES = [(512, 40), (768, 13)] if not QUICK else [(512, 40)]
TS = (1, 3, 17) if not QUICK else (1, 5)


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("n_in,n_out", SHAPES)
@pytest.mark.parametrize("name", IQ_TYPES)
def test_linear_vs_torch(pool, name, n_in, n_out, T):
    rng = np.random.default_rng(1000 + IQ_TYPES.index(name) + n_in)
    raw, deq = iq_weights(name, (n_out, n_in), rng)
    w_torch = dq.dequantize(raw.reshape(-1), name, shape=(n_out, n_in)).double()
    assert np.array_equal(w_torch.float().numpy(), deq)
    lin = K.LinearKernel(pool, "llamafile", n_in, n_out, raw, name)
    x = torch.randn(T, n_in, generator=torch.Generator().manual_seed(T))
    y = lin.forward(x)
    err = rel_err(y.numpy(), (x.double() @ w_torch.T).numpy())
    assert err < tol(name), f"{name} [{decode_kernel(name)}] {n_in}x{n_out} T={T}: rel err {err:.3g}"
    # a one-row matrix (its tile repeats the row) gives that row of the full one
    lin1 = K.LinearKernel(pool, "llamafile", n_in, 1, np.ascontiguousarray(raw[:1]), name)
    np.testing.assert_allclose(lin1.forward(x).numpy(), y[:, :1].numpy(), rtol=1e-5, atol=1e-6 * y.abs().max().item())


def test_linear_group_takes_iq_members(pool):
    """The lean decode step's fused q/k/v-style call: IQ members next to a K-quant, same outputs."""
    rng = np.random.default_rng(5)
    lins = [K.LinearKernel(pool, "llamafile", 512, o, iq_weights(n, (o, 512), rng)[0], n)
            for n, o in (("IQ2_XXS", 64), ("IQ3_S", 40), ("IQ1_M", 24))]
    group = K.LinearGroupKernel(lins)
    x = torch.randn(1, 512)
    out = torch.full((1, 128), float("nan"))
    group.forward(x, out)
    assert torch.equal(out, torch.cat([lin.forward(x) for lin in lins], dim=-1))


def _moe_file(tmp_path, E, H, I, name):
    p = tmp_path / "iq_moe.gguf"
    w = gguf.GGUFWriter(str(p), arch="qwen3moe")
    w.add_block_count(1)
    w.add_head_count(4)
    w.add_embedding_length(H)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(I)
    rng = np.random.default_rng(7)
    for proj, (r, c) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
        raw = iq_blocks(name, E * r * c // 256, rng, scale=0.5).reshape(E, r, -1)
        w.add_tensor(f"blk.0.ffn_{proj}_exps.weight", raw, raw_dtype=gguf.GGMLQuantizationType[name])
    return finish(w, p)


@pytest.mark.parametrize("T", (1, 9))
def test_moe_experts_op_vs_torch_experts(tmp_path, T):
    """KExpertsCPU (llamafile, IQ2_XXS read in place) against KExpertsTorch on the same GGUF."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from ktransformers.operators.cpu_experts import KExpertsCPU
    from ktransformers.operators.experts import KExpertsTorch
    from ktransformers.weights.gguf_source import GGUFSource

    E, H, I = 4, 256, 512
    src = GGUFSource(_moe_file(tmp_path, E, H, I, "IQ2_XXS"))
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                         vocab_size=32)
    key = "model.layers.0.mlp.experts"
    cpu = KExpertsCPU(key, cfg, Qwen3MoeExperts(cfg), "cpu", backend="llamafile")
    ref = KExpertsTorch(key, cfg, Qwen3MoeExperts(cfg), "cpu")
    cpu.load(src, torch.float32)
    ref.load(src, torch.float32)
    assert isinstance(cpu._arrays["gate_proj"], np.ndarray), "IQ2_XXS experts must be read in place, not as floats"
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g) + 0.1
    got = cpu.forward(x, ids, w)
    want = ref.forward(x.double().float(), ids, w)
    err = rel_err(got.numpy(), want.double().numpy())
    limit = 1e-4 if decode_kernel("IQ2_XXS") == "generic" else 3e-2
    assert err < limit, f"MoE IQ2_XXS [{decode_kernel('IQ2_XXS')}] T={T}: rel err {err:.3g}"


def test_scalar_tier_subprocess():
    """The same tests on the baseline tier (generic path), where this CPU has a higher one."""
    if os.environ.get("KT_ISA"):
        pytest.skip("already running under a forced KT_ISA")
    if K.isa_tier() == "scalar":
        pytest.skip("the baseline tier is the native one here")
    env = dict(os.environ, KT_ISA="scalar", KT_TEST_QUICK="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
