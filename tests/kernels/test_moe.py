"""MoE kernel vs a float64 reference on the dequantised weights (gguf.quants.dequantize).

Tolerances are ||out - ref|| / ||ref|| (relative to the output scale):
  * weights dequantised exactly, fp32 activations (generic path, F32/F16)      1e-4
  * BF16 weights (bf16 activations on AVX512-BF16)                             1e-2
  * int8-quantised activations (Q8_0 / Q4_K integer dot products)              3e-2
  * AMXBF16 (weights rounded to bf16, activations bf16)                        2e-2
  * AMXInt8 (weights requantised to int8 per row, activations int8 per 128)    4e-2
The float64 reference uses the exact dequantised weights, so every quantisation step of the
kernel (activations, bf16 rounding, int8 requantisation) counts as error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import QUICK
from gguf import GGMLQuantizationType as QT
from quant_ref import ALL_TYPES, block_elems, make_weights
from ref import moe_ref, rel_err

import ktransformers.kernels as K
from ktransformers import cpuinfer_ext as ext

E, TOPK = 8, 3
SHAPES = {"H256_I512": (256, 512), "H320_I96": (320, 96)}  # second one: not multiples of 256
TS = (1, 64) if QUICK else (1, 3, 64, 300)

_layers: dict = {}


def layer(t: QT, shape: str):
    key = (t, shape)
    if key not in _layers:
        H, I = SHAPES[shape]
        rng = np.random.default_rng(int(t) * 7 + len(shape))
        g = make_weights(t, (E, I, H), rng)
        u = make_weights(t, (E, I, H), rng)
        d = make_weights(t, (E, H, I), rng)
        _layers[key] = (H, I, g, u, d)
    return _layers[key]


def routing(T: int, rng, skew: bool = False):
    if skew:  # every token hits expert 2 and two of {0,1}; experts 3..7 get no tokens
        ids = np.stack([np.full(T, 2), rng.integers(0, 2, T), 1 - rng.integers(0, 2, T)], 1)
        ids[:, 2] = np.where(ids[:, 1] == ids[:, 2], -1, ids[:, 2])  # -1 = skipped slot
    else:
        ids = np.stack([rng.permutation(E)[:TOPK] for _ in range(T)])
    w = rng.uniform(0.1, 1.0, size=(T, TOPK)).astype(np.float32)
    return ids.astype(np.int64), w


def tol(backend: str, t: QT) -> float:
    if backend == "AMXInt8":
        return 4e-2
    if backend == "AMXBF16":
        return 2e-2
    if t in (QT.F32, QT.F16):
        return 1e-4
    if t == QT.BF16:
        return 1e-2
    return 3e-2


def type_shape_params():
    out = []
    for t in ALL_TYPES:
        for s, (H, I) in SHAPES.items():
            if H % block_elems(t) or I % block_elems(t):
                continue
            if QUICK and s != "H256_I512":
                continue
            out.append(pytest.param(t, s, id=f"{t.name}-{s}"))
    return out


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


def run_case(pool, backend, t, shape, T, act="silu", skew=False, x_bf16=False, limit=7.0, clamped=None):
    H, I, (gr, gd), (ur, ud), (dr, dd) = layer(t, shape)
    moe = K.MoEKernel(pool, backend, E, H, I, gr, ur, dr, t, t, t, activation=act, limit=limit)
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, w = routing(T, rng, skew)
    ref = moe_ref(x, ids, w, gd, ud, dd, act, limit=limit, clamped=clamped)
    if x_bf16:
        xt = torch.from_numpy(x).to(torch.bfloat16)
        ref = moe_ref(xt.float().numpy(), ids, w, gd, ud, dd, act)
        out = moe.forward(xt, torch.from_numpy(ids), torch.from_numpy(w)).float().numpy()
    else:
        out = moe.forward(x, ids, w)
    return rel_err(out, ref)


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("t,shape", type_shape_params())
def test_llamafile(pool, t, shape, T):
    err = run_case(pool, "llamafile", t, shape, T)
    assert err < tol("llamafile", t), f"{t.name} {shape} T={T}: rel err {err:.3g}"


AMX_SRC = [QT.BF16, QT.F32, QT.Q8_0, QT.Q4_K] if not QUICK else [QT.BF16, QT.Q4_K]


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("t", AMX_SRC, ids=lambda t: t.name)
@pytest.mark.parametrize("backend", ["AMXInt8", "AMXBF16"])
def test_packed_backends(pool, backend, t, T):
    shape = "H256_I512"
    err = run_case(pool, backend, t, shape, T)
    assert err < tol(backend, t), f"{backend} from {t.name} T={T}: rel err {err:.3g}"
    if t == QT.F32 and not QUICK:  # shapes that need K / row padding in the packed layout
        err = run_case(pool, backend, t, "H320_I96", T)
        assert err < tol(backend, t), f"{backend} H320_I96 T={T}: rel err {err:.3g}"


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "clamp_swiglu", "clamp_silu"])
def test_activations(pool, act):
    """The clamped activations with a limit that some gate pre-activations exceed (the clamps bite)."""
    clamped = []
    limit = 0.5 if act.startswith("clamp_") else 7.0
    assert run_case(pool, "llamafile", QT.F32, "H320_I96", 5, act=act, limit=limit, clamped=clamped) < 1e-4
    if act.startswith("clamp_"):
        assert 0.05 < np.mean(clamped) < 0.95


@pytest.mark.parametrize("backend,t", [("AMXInt8", QT.BF16), ("AMXBF16", QT.BF16)])
def test_clamp_silu_packed(pool, backend, t):
    """The packed backends apply the same gated activation after their own gate/up products."""
    assert run_case(pool, backend, t, "H256_I512", 7, act="clamp_silu", limit=0.5) < tol(backend, t)


@pytest.mark.parametrize("backend,t", [("llamafile", QT.Q4_K), ("llamafile", QT.Q8_0), ("AMXInt8", QT.BF16)])
def test_skewed_routing_and_skipped_slots(pool, backend, t):
    assert run_case(pool, backend, t, "H256_I512", 200, skew=True) < tol(backend, t)


def test_bf16_io(pool):
    assert run_case(pool, "llamafile", QT.Q8_0, "H256_I512", 7, x_bf16=True) < 3e-2


def test_submit_sync_and_single_thread():
    H, I, (gr, gd), (ur, ud), (dr, dd) = layer(QT.Q4_K, "H256_I512")
    rng = np.random.default_rng(1)
    for threads in (1, 2):
        pool = K.CPUInfer(threads)
        moe = K.MoEKernel(pool, "llamafile", E, H, I, gr, ur, dr, "Q4_K", "Q4_K", "Q4_K")
        xs = [rng.standard_normal((T, H)).astype(np.float32) for T in (1, 2, 33)]
        routes = [routing(x.shape[0], rng) for x in xs]
        outs = [np.empty_like(x) for x in xs]
        for x, (ids, w), o in zip(xs, routes, outs):
            moe.submit(x, ids, w, o)
        pool.sync()
        for x, (ids, w), o in zip(xs, routes, outs):
            assert rel_err(o, moe_ref(x, ids, w, gd, ud, dd)) < 3e-2


def test_errors(pool):
    H, I, (gr, _), (ur, _), (dr, _) = layer(QT.Q8_0, "H256_I512")
    moe = K.MoEKernel(pool, "llamafile", E, H, I, gr, ur, dr, "Q8_0", "Q8_0", "Q8_0")
    x = np.zeros((2, H), np.float32)
    w = np.ones((2, TOPK), np.float32)
    with pytest.raises(IndexError, match="expert id 8"):
        moe.forward(x, np.full((2, TOPK), 8, np.int64), w)
    with pytest.raises(ValueError, match=r"x: expected shape \[T, 256\]"):
        moe.forward(np.zeros((2, 100), np.float32), np.zeros((2, TOPK), np.int64), w)
    with pytest.raises(TypeError, match="x: expected float32 or bfloat16"):
        moe.forward(np.zeros((2, H), np.float64), np.zeros((2, TOPK), np.int64), w)
    with pytest.raises(ValueError, match="weights: expected shape"):
        moe.forward(x, np.zeros((2, TOPK), np.int64), np.ones((2, 2), np.float32))
    # async errors surface at sync()
    moe.submit(x, np.full((2, TOPK), 99, np.int64), w, np.empty_like(x))
    with pytest.raises(IndexError):
        pool.sync()
    # K-quant rows need multiples of 256: DeepSeek-V2-Lite's I=1408 is rejected with the shape
    with pytest.raises(ValueError, match=r"down.*Q4_K.*1408"):
        K.MoEKernel(pool, "llamafile", 2, 256, 1408, np.zeros(2 * 1408 * 144, np.uint8),
                    np.zeros(2 * 1408 * 144, np.uint8), np.zeros(2 * 256 * 1408 // 256 * 144, np.uint8),
                    "Q4_K", "Q4_K", "Q4_K")
    with pytest.raises(ValueError, match="gate: expected 123 bytes|gate: expected"):
        K.MoEKernel(pool, "llamafile", E, H, I, gr[:1], ur, dr, "Q8_0", "Q8_0", "Q8_0")
    with pytest.raises(ValueError, match="backend"):
        K.MoEKernel(pool, "cuda", E, H, I, gr, ur, dr, "Q8_0", "Q8_0", "Q8_0")
    with pytest.raises(ValueError, match="gate_type"):
        K.MoEKernel(pool, "llamafile", E, H, I, gr, ur, dr, "Q9_9", "Q8_0", "Q8_0")
    assert moe.forward(np.zeros((0, H), np.float32), np.zeros((0, TOPK), np.int64),
                       np.zeros((0, TOPK), np.float32)).shape == (0, H)


def test_torch_float_weights(pool):
    H, I = 256, 96
    g = torch.randn(E, I, H, dtype=torch.bfloat16) * 0.05
    u = torch.randn(E, I, H, dtype=torch.bfloat16) * 0.05
    d = torch.randn(E, H, I, dtype=torch.bfloat16) * 0.05
    moe = K.MoEKernel(pool, "AMXBF16", E, H, I, g, u, d, "BF16", "BF16", "BF16")
    rng = np.random.default_rng(3)
    x = torch.randn(4, H)
    ids, w = routing(4, rng)
    out = moe.forward(x, torch.from_numpy(ids), torch.from_numpy(w))
    ref = moe_ref(x.numpy(), ids, w, g.float().numpy(), u.float().numpy(), d.float().numpy())
    assert rel_err(out.numpy(), ref) < 2e-2


def test_torch_fast_path_matches_checked_path(pool):
    """MoEKernel takes a short validation path for contiguous torch CPU tensors of the exact
    dtypes; anything else goes through the full checks (conversions and errors unchanged)."""
    H, I, (gr, gd), (ur, ud), (dr, dd) = layer(QT.Q4_K, "H256_I512")
    moe = K.MoEKernel(pool, "llamafile", E, H, I, gr, ur, dr, "Q4_K", "Q4_K", "Q4_K")
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32))
    ids_np, w_np = routing(3, rng)
    ids, w = torch.from_numpy(ids_np), torch.from_numpy(w_np)
    ref = moe_ref(x.numpy(), ids_np, w_np, gd, ud, dd)
    fast = moe.forward(x, ids, w, torch.empty(3, H))                      # fast path
    slow = moe.forward(x.numpy(), ids_np, w_np)                            # numpy: checked path
    conv = moe.forward(x, ids.to(torch.int32), w.double(), torch.empty(3, H))  # converted ids / weights
    for o in (fast, slow, conv):
        assert rel_err(np.asarray(o), ref) < 3e-2
    np.testing.assert_array_equal(fast.numpy(), slow)
    np.testing.assert_array_equal(fast.numpy(), conv.numpy())
    with pytest.raises(ValueError, match="x: must be contiguous"):
        moe.forward(torch.zeros(H, 3).T, ids, w, torch.empty(3, H))
    with pytest.raises(ValueError, match=r"out: expected shape \[3, 256\]"):
        moe.forward(x, ids, w, torch.empty(3, H + 1))
    with pytest.raises(ValueError, match="weights: expected shape"):
        moe.forward(x, ids, w[:, :2].contiguous(), torch.empty(3, H))
    with pytest.raises(TypeError, match="x: expected float32 or bfloat16"):
        moe.forward(x.double(), ids, w, torch.empty(3, H))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("down", [QT.Q4_K, QT.Q6_K])
def test_llamafile_panels_give_llamafile_bits(down, threads):
    """``llamafile_panels`` (Q4_K copied into 16-row panels of its own integers; the Q6_K down of a
    Q4_K_M layer read in place): outputs bit for bit the llamafile backend's, for every token count
    (the decode row tiles, the prompt panels, the panel layout's tiles), skewed routing included."""
    pool = K.cpu_infer(threads)
    H, I = 256, 512
    rng = np.random.default_rng(11)
    g, u = (make_weights(QT.Q4_K, (E, I, H), rng)[0] for _ in range(2))
    d = make_weights(down, (E, H, I), rng)[0]
    ref = K.MoEKernel(pool, "llamafile", E, H, I, g, u, d, QT.Q4_K, QT.Q4_K, down)
    pan = K.MoEKernel(pool, "llamafile_panels", E, H, I, g, u, d, QT.Q4_K, QT.Q4_K, down)
    if ext.packed_rows()["llamafile_panels"][0] != "llamafile":  # a tier with the panel kernel: a copy
        q4k = 3 if down == QT.Q4_K else 2
        assert pan.packed_bytes == q4k * E * (I * H // 256) * 2368 // 16
    for T in (1, 2, 3, 5, 6, 31, 100):
        for skew in (False, True):
            x = rng.standard_normal((T, H)).astype(np.float32)
            ids, w = routing(T, rng, skew)
            a, b = ref.forward(x, ids, w), pan.forward(x, ids, w)
            assert np.array_equal(a, b), f"T={T} skew={skew}: max |diff| {np.abs(a - b).max():.3g}"
