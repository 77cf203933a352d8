"""Dense Linear kernel (y = x @ W^T) vs float64 numpy on the dequantised weights.
Tolerances (||y - ref|| / ||ref||) as in test_moe.py: 1e-4 exact-fp32 paths, 1e-2 BF16,
2e-2 int8-activation paths and AMXBF16, 3e-2 AMXInt8 (one projection instead of three)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import QUICK
from gguf import GGMLQuantizationType as QT
from quant_ref import ALL_TYPES, block_elems, make_weights
from ref import rel_err

import ktransformers.kernels as K

# (in, out); 96 is not a multiple of 256, 33 not of 16; 800 = 25 blocks of 32 (a partial, odd
# 16-block chunk in the Q8_32 kernels), 768 = 3 superblocks (IQ4_XS: one full + one half chunk)
SHAPES = [(512, 40), (96, 33), (800, 7), (768, 21)]
TS = (1, 64) if QUICK else (1, 2, 3, 5, 6, 12, 64, 300)  # row tiles and partial panel token blocks, per tier


def tol(backend, t):
    if backend == "AMXInt8":
        return 3e-2
    if backend == "AMXBF16":
        return 2e-2
    if t in (QT.F32, QT.F16):
        return 1e-4
    return 1e-2 if t == QT.BF16 else 2e-2


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


def params():
    out = []
    for t in ALL_TYPES:
        for (i, o) in SHAPES:
            if i % block_elems(t) == 0 and not (QUICK and i != 512):
                out.append(pytest.param("llamafile", t, i, o, id=f"llamafile-{t.name}-{i}x{o}"))
    for b in ("AMXInt8", "AMXBF16"):
        for t in (QT.BF16, QT.Q4_K) if QUICK else (QT.BF16, QT.F32, QT.Q8_0, QT.Q4_K):
            for (i, o) in SHAPES:
                if i % block_elems(t) == 0:
                    out.append(pytest.param(b, t, i, o, id=f"{b}-{t.name}-{i}x{o}"))
    return out


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("backend,t,n_in,n_out", params())
def test_linear(pool, backend, t, n_in, n_out, T):
    rng = np.random.default_rng(int(t) + n_in)
    raw, deq = make_weights(t, (n_out, n_in), rng)
    lin = K.LinearKernel(pool, backend, n_in, n_out, raw, t)
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    y = lin.forward(x)
    err = rel_err(y, x.astype(np.float64) @ deq.T.astype(np.float64))
    assert err < tol(backend, t), f"{backend} {t.name} {n_in}x{n_out} T={T}: rel err {err:.3g}"


# Token counts around the packed kernels' blocking: AMX tiles take 16 tokens each, two at a
# time (2 = the smallest tile call, 20 = a full and a partial tile, 45 = a second block of 13),
# the VNNI-512 tiles 4 tokens; 40 and 33 rows end on a lone, partial panel.
@pytest.mark.parametrize("T", (2, 20, 45))
@pytest.mark.parametrize("n_in,n_out", [(512, 40), (96, 33)])
@pytest.mark.parametrize("backend", ["AMXInt8", "AMXBF16"])
def test_packed_token_blocks(pool, backend, n_in, n_out, T):
    rng = np.random.default_rng(T + n_out)
    raw, deq = make_weights(QT.F32, (n_out, n_in), rng)
    lin = K.LinearKernel(pool, backend, n_in, n_out, raw, QT.F32)
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    err = rel_err(lin.forward(x), x.astype(np.float64) @ deq.T.astype(np.float64))
    assert err < tol(backend, QT.F32), f"{backend} {n_in}x{n_out} T={T}: rel err {err:.3g}"


# Llamafile prefill on the AMX tier (tiles over dequantised bf16 rows from a per-type token count,
# see kern_amx.cpp): odd token blocks of 16, a partial last one, row groups of 32 ending partial.
# (BF16 with 40 inputs: not a multiple of the tiles' 32 k, so the tier's own kernel serves it.)
@pytest.mark.parametrize("t,T,n_in", [(QT.BF16, 45, 512), (QT.BF16, 45, 40), (QT.Q4_K, 70, 512),
                                      (QT.Q6_K, 150, 512), (QT.Q2_K, 97, 512)])
def test_llamafile_prefill_token_blocks(pool, t, T, n_in):
    n_out = 40
    rng = np.random.default_rng(T)
    raw, deq = make_weights(t, (n_out, n_in), rng)
    lin = K.LinearKernel(pool, "llamafile", n_in, n_out, raw, t)
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    err = rel_err(lin.forward(x), x.astype(np.float64) @ deq.T.astype(np.float64))
    assert err < tol("llamafile", t), f"{t.name} T={T}: rel err {err:.3g}"


def test_linear_bf16_io_and_submit(pool):
    w = torch.randn(48, 256) * 0.1
    lin = K.LinearKernel(pool, "llamafile", 256, 48, w, "F32")
    x = torch.randn(5, 256).to(torch.bfloat16)
    y = lin.forward(x)
    assert y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T
    assert rel_err(y.float().numpy(), ref.numpy()) < 1e-2
    out = torch.empty(5, 48)
    lin.submit(x, out)
    pool.sync()
    assert rel_err(out.numpy(), ref.numpy()) < 1e-4
    with pytest.raises(ValueError, match=r"x: expected shape \[T, 256\]"):
        lin.forward(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="Q4_K stores rows in blocks of 256"):
        K.LinearKernel(pool, "llamafile", 100, 4, np.zeros(4, np.uint8), "Q4_K")
    with pytest.raises(TypeError, match="weight: expected uint8 bytes of Q8_0"):
        K.LinearKernel(pool, "llamafile", 256, 4, np.zeros((4, 256), np.float32), "Q8_0")


def test_dequantize_matches_gguf():
    rng = np.random.default_rng(5)
    for t in ALL_TYPES:
        raw, deq = make_weights(t, (2, 512), rng)
        np.testing.assert_array_equal(K.dequantize(raw, t), deq.ravel())


def test_linear_torch_fast_path(pool):
    """The torch decode fast path (no validation) gives the same result as the checked path and
    leaves the errors to the checked path."""
    rng = np.random.default_rng(3)
    for t in (QT.Q8_0, QT.Q5_0, QT.Q4_K):
        raw, deq = make_weights(t, (37, 512), rng)
        lin = K.LinearKernel(pool, "llamafile", 512, 37, raw, t)
        for T in (1, 2, 4, 20):
            x = torch.randn(T, 512)
            out = torch.empty(T, 37)
            lin.forward(x, out)  # fast path
            ref = lin.forward(x.numpy())  # checked path (numpy)
            np.testing.assert_array_equal(out.numpy(), ref)
            yb = lin.forward(x.to(torch.bfloat16), torch.empty(T, 37, dtype=torch.bfloat16))
            assert rel_err(yb.float().numpy(), ref) < 2e-2
    with pytest.raises(ValueError, match=r"out: expected shape \[1, 37\]"):
        lin.forward(torch.zeros(1, 512), torch.empty(1, 36))
    with pytest.raises(ValueError, match="must be contiguous"):
        lin.forward(torch.zeros(512, 2).t(), torch.empty(2, 37))
    with pytest.raises(TypeError, match="x: expected float32 or bfloat16"):
        lin.forward(torch.zeros(1, 512, dtype=torch.float64), torch.empty(1, 37))


def test_llamafile_panels_linear_gives_llamafile_bits():
    """``LinearKernel`` on ``llamafile_panels``: a Q4_K weight (rows not a multiple of 16: the last
    panel padded) packed into panels, a Q8_0 one read in place; the outputs are llamafile's bits."""
    pool = K.cpu_infer(2)
    rng = np.random.default_rng(5)
    for t, (out_f, in_f) in ((QT.Q4_K, (200, 512)), (QT.Q8_0, (64, 96))):
        w = make_weights(t, (out_f, in_f), rng)[0]
        ref = K.LinearKernel(pool, "llamafile", in_f, out_f, w, t)
        pan = K.LinearKernel(pool, "llamafile_panels", in_f, out_f, w, t)
        for T in (1, 3, 7, 64):
            x = rng.standard_normal((T, in_f)).astype(np.float32)
            assert np.array_equal(ref.forward(x), pan.forward(x)), f"{t.name} T={T}"
