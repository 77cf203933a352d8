"""AMXInt4 / AMXInt4_1 MoE backends vs a float64 reference.

The weights are requantised at load to int4 in groups of 32 along K (fp16 scale, plus an fp16
min for AMXInt4_1); `int4_round` below re-derives those int4 weights independently in numpy.
Tolerances (||out - ref|| / ||ref||):
  * vs the int4-rounded weights: only the kernel's own error (int8 activations per 32)   3e-2
    (measured 1.1e-2 - 1.2e-2 on every tier)
  * vs the original weights: int4 rounding included                                      0.2
    (measured AMXInt4 0.14 - 0.16, AMXInt4_1 0.05 (from Q4_K) - 0.14)
Shapes include K = 320 / 96 / 200 (not all multiples of 32 or 128: padding) and 13-row tails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import QUICK, int_kernel_suffix
from gguf import GGMLQuantizationType as QT
from quant_ref import make_weights
from ref import moe_ref, rel_err

import ktransformers.cpuinfer_ext as ext
import ktransformers.kernels as K

E, TOPK, GROUP = 8, 3, 32
BACKENDS = ("AMXInt4", "AMXInt4_1")
TS = (1, 5) if QUICK else (1, 2, 7, 70)


def int4_round(w: np.ndarray, with_min: bool) -> np.ndarray:
    """The dequantised int4 weights: per row and 32-k group, q = round(w / d) (+ 8) in 0..15
    with the fp16-rounded d (and min); w' = d * (q - 8) or d * q + m.  Zero padding to 32."""
    w = np.asarray(w, np.float32)
    K_ = w.shape[-1]
    Kp = -(-K_ // GROUP) * GROUP
    wp = np.zeros(w.shape[:-1] + (Kp,), np.float32)
    wp[..., :K_] = w
    g = wp.reshape(w.shape[:-1] + (Kp // GROUP, GROUP))
    if with_min:
        lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
        d = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
        m = lo.astype(np.float16).astype(np.float32)
    else:
        big = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)
        d = (big / np.float32(-8)).astype(np.float16).astype(np.float32)
        m = None
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    if with_min:
        q = np.clip(np.rint((g - m) * inv), 0, 15)
        out = d * q + m
    else:
        q = np.clip(np.rint(g * inv) + 8, 0, 15)
        out = d * (q - 8)
    return out.reshape(wp.shape)[..., :K_]


_layers: dict = {}


def layer(t: QT, H: int, I: int):
    key = (t, H, I)
    if key not in _layers:
        rng = np.random.default_rng(int(t) * 31 + H + I)
        _layers[key] = tuple(make_weights(t, s, rng) for s in ((E, I, H), (E, I, H), (E, H, I)))
    return _layers[key]


def routing(T: int, rng, kind: str):
    if kind == "skew":  # all tokens on expert 2 plus one of {0, 1}; a skipped slot (-1)
        ids = np.stack([np.full(T, 2), rng.integers(0, 2, T), np.full(T, -1)], 1)
    elif kind == "one":  # every token on the same three experts
        ids = np.tile(np.array([5, 0, 7]), (T, 1))
    else:
        ids = np.stack([rng.permutation(E)[:TOPK] for _ in range(T)])
    w = rng.uniform(0.1, 1.0, size=(T, TOPK)).astype(np.float32)
    return ids.astype(np.int64), w


def check(pool, backend, t, H, I, T, kind="random"):
    (gr, gd), (ur, ud), (dr, dd) = layer(t, H, I)
    moe = K.MoEKernel(pool, backend, E, H, I, gr, ur, dr, t, t, t)
    rng = np.random.default_rng(T + H)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, w = routing(T, rng, kind)
    out = moe.forward(x, ids, w)
    mn = backend == "AMXInt4_1"
    e_q = rel_err(out, moe_ref(x, ids, w, int4_round(gd, mn), int4_round(ud, mn), int4_round(dd, mn)))
    e_w = rel_err(out, moe_ref(x, ids, w, gd, ud, dd))
    where = f"{backend} from {t.name} H{H} I{I} T={T} {kind}"
    assert e_q < 3e-2, f"{where}: rel err vs int4 weights {e_q:.3g}"
    assert e_w < 0.2, f"{where}: rel err vs original weights {e_w:.3g}"
    return moe, e_q, e_w


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_source(pool, backend, T):
    check(pool, backend, QT.BF16, 256, 512, T)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H,I", [(320, 96), (200, 72)])
def test_padded_k_and_rows(pool, backend, H, I):
    """K = 320 / 96 (not multiples of 128), 200 / 72 (not multiples of 32); I = 72 rows leaves
    a partial 16-row panel."""
    for T in (1, 9):
        check(pool, backend, QT.F32, H, I, T)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [QT.Q4_K, QT.Q8_0], ids=lambda t: t.name)
def test_gguf_sources(pool, backend, t):
    check(pool, backend, t, 256, 512, 1 if QUICK else 33)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["skew", "one"])
def test_routing_patterns(pool, backend, kind):
    check(pool, backend, QT.BF16, 256, 512, 40 if QUICK else 130, kind)


def test_memory_and_kernel_names(pool):
    """int4 holds half the weight bytes of AMXInt8 (+ fp16 scales / mins per 32); the kernel
    table names the kernel of each backend."""
    (gr, _), (ur, _), (dr, _) = layer(QT.BF16, 256, 512)
    nb = {b: K.MoEKernel(pool, b, E, 256, 512, gr, ur, dr, "BF16", "BF16", "BF16").packed_bytes
          for b in ("AMXInt8", "AMXInt4", "AMXInt4_1")}
    n = 3 * E * 256 * 512
    assert nb["AMXInt4"] == pytest.approx(n * (0.5 + 2 / 32), rel=1e-3)
    assert nb["AMXInt4_1"] == pytest.approx(n * (0.5 + 4 / 32), rel=1e-3)
    assert nb["AMXInt4"] < 0.6 * nb["AMXInt8"]
    rows = ext.packed_rows()
    for b in BACKENDS:
        dec, pre, act = rows[b]
        assert dec.startswith("i4") and pre.startswith("i4") and act == "q8_32", rows[b]
    if K.isa_tier() in ("avx512vnni", "avx512bf16", "amx"):
        assert "vnni512" in rows["AMXInt4"][0]
    if K.isa_tier() in ("avx2", "avxvnni"):  # the packed int8 / int4 kernels share the tier's dot helpers
        sfx = int_kernel_suffix(K.isa_tier())
        assert rows["AMXInt8"][0] == "i8" + sfx and rows["AMXInt4"][0] == "i4" + sfx, rows


def test_bf16_io_and_torch_weights(pool):
    H, I = 256, 96
    torch.manual_seed(0)
    g, u, d = (torch.randn(E, r, c, dtype=torch.bfloat16) * 0.05 for r, c in ((I, H), (I, H), (H, I)))
    moe = K.MoEKernel(pool, "AMXInt4_1", E, H, I, g, u, d, "BF16", "BF16", "BF16")
    rng = np.random.default_rng(3)
    x = torch.randn(6, H).to(torch.bfloat16)
    ids, w = routing(6, rng, "random")
    out = moe.forward(x, torch.from_numpy(ids), torch.from_numpy(w))
    assert out.dtype == torch.bfloat16
    ref = moe_ref(x.float().numpy(), ids, w, *(int4_round(a.float().numpy(), True) for a in (g, u, d)))
    assert rel_err(out.float().numpy(), ref) < 3e-2


def test_linear_kernel(pool):
    """LinearKernel shares the packed backends: a 13 x 200 int4 matrix."""
    rng = np.random.default_rng(5)
    wt = (rng.standard_normal((13, 200)) * 0.05).astype(np.float32)
    for b, mn in zip(BACKENDS, (False, True)):
        lin = K.LinearKernel(pool, b, 200, 13, wt, "F32")
        x = rng.standard_normal((5, 200)).astype(np.float32)
        assert rel_err(lin.forward(x), x.astype(np.float64) @ int4_round(wt, mn).T.astype(np.float64)) < 3e-2


def test_no_training_path(pool):
    (gr, _), (ur, _), (dr, _) = layer(QT.BF16, 256, 512)
    moe = K.MoEKernel(pool, "AMXInt4", E, 256, 512, gr, ur, dr, "BF16", "BF16", "BF16")
    with pytest.raises(ValueError, match="backend AMXInt4 has no backward; use llamafile, AMXInt8 or AMXBF16"):
        K.MoETrainKernel(moe)
