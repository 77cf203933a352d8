"""Batch invariance of the CPU kernels, bitwise: a token's output row is the same whether it runs
alone, beside other tokens (any count: the decode row tiles, the prefill panels, partial token
blocks), or in another position of the batch.  Every weight type and backend, the low-bit IQ
types, LinearGroup (fused q/k/v, gated gate/up) and the MoE layer (a token's experts shared with
any number of other tokens).  test_isa.py re-runs this file at every lower tier the CPU offers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import QUICK
from gguf import GGMLQuantizationType as QT
from quant_ref import ALL_TYPES, block_elems, make_weights
from test_iq_kernels import IQ_TYPES, iq_blocks

import ktransformers.kernels as K

# batch sizes around every tile boundary: row tiles (1-4), panels (from 3, 5 or 6), token blocks
BATCHES = (2, 5, 9, 70) if QUICK else (2, 3, 4, 5, 6, 7, 8, 9, 17, 70, 300)
BACKENDS = ("llamafile", "AMXInt8", "AMXBF16", "AMXInt4")


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


def _alone(fn, x):
    return np.concatenate([fn(np.ascontiguousarray(x[i:i + 1])) for i in range(len(x))])


def _check(fn, x, rng, what):
    """Rows of x alone, then inside batches of other random rows at random positions."""
    alone = _alone(fn, x)
    for n in BATCHES:
        others = rng.standard_normal((n, x.shape[1])).astype(np.float32)
        pos = rng.choice(n, size=min(len(x), n), replace=False)
        batch = others.copy()
        batch[pos] = x[:len(pos)]
        y = fn(batch)
        for j, p in enumerate(pos):
            assert np.array_equal(y[p], alone[j]), f"{what}: row alone != row {p} of a batch of {n} (max diff {np.abs(y[p] - alone[j]).max():.3g})"


def _linear_params():
    out = []
    for b in BACKENDS:
        for t in ALL_TYPES:
            if QUICK and t not in (QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q5_0, QT.Q4_1, QT.BF16):
                continue
            out.append(pytest.param(b, t, id=f"{b}-{t.name}"))
    return out


@pytest.mark.parametrize("backend,t", _linear_params())
def test_linear_rows_do_not_depend_on_the_batch(pool, backend, t):
    rng = np.random.default_rng(int(t) * 13 + len(backend))
    # 800 inputs: 25 blocks of 32 (a last 16-block chunk of 9); 672: 21 (a last chunk of 5, at most
    # 8: the row tiles' short tail, an odd block); 768 = 3 superblocks
    for n_in in ((800, 672) if 800 % block_elems(t) == 0 else (768,)):
        raw, _ = make_weights(t, (70, n_in), rng)
        try:
            lin = K.LinearKernel(pool, backend, n_in, 70, raw, t)
        except ValueError as e:
            pytest.skip(f"{backend} does not take {t.name} here: {e}")
        x = rng.standard_normal((6, n_in)).astype(np.float32)
        _check(lin.forward, x, rng, f"{backend} {t.name} K={n_in}")


@pytest.mark.parametrize("name", IQ_TYPES[:2] if QUICK else IQ_TYPES)
def test_iq_linear_rows_do_not_depend_on_the_batch(pool, name):
    rng = np.random.default_rng(len(name))
    raw = iq_blocks(name, 40 * 768 // 256, rng).reshape(40, -1)
    lin = K.LinearKernel(pool, "llamafile", 768, 40, raw, name)
    _check(lin.forward, rng.standard_normal((4, 768)).astype(np.float32), rng, name)


@pytest.mark.parametrize("glu", [None, "silu"])
def test_linear_group_rows_do_not_depend_on_the_batch(pool, glu):
    rng = np.random.default_rng(7)
    types = (QT.Q5_0, QT.Q5_0) if glu else (QT.Q4_K, QT.Q8_0, QT.Q6_K)
    outs = (96, 96) if glu else (128, 64, 64)
    members = []
    for t, o in zip(types, outs):
        raw, _ = make_weights(t, (o, 512), rng)
        members.append(K.LinearKernel(pool, "llamafile", 512, o, raw, t))
    g = K.LinearGroupKernel(members, glu=glu)

    def fn(x):
        out = torch.empty((len(x), g.out_features), dtype=torch.float32)
        return g.forward(torch.from_numpy(np.ascontiguousarray(x)), out).numpy()

    _check(fn, rng.standard_normal((5, 512)).astype(np.float32), rng, f"group glu={glu}")


@pytest.mark.parametrize("backend,t", [pytest.param(b, t, id=f"{b}-{t.name}") for b, t in
                                       [("llamafile", QT.Q4_K), ("llamafile", QT.Q6_K), ("llamafile", QT.Q8_0),
                                        ("llamafile", QT.Q5_0), ("llamafile", QT.BF16), ("AMXInt8", QT.Q4_K),
                                        ("AMXBF16", QT.BF16), ("AMXInt4", QT.Q4_K)]])
def test_moe_tokens_do_not_depend_on_the_batch(pool, backend, t):
    """A token's experts see 0..n other tokens (the expert's token count picks the tile); the k
    slots are added in their order whatever the grouping."""
    E, H, I, k = 8, 256, 512, 3
    rng = np.random.default_rng(int(t) + 5)
    g, u, d = (make_weights(t, s, rng)[0] for s in ((E, I, H), (E, I, H), (E, H, I)))
    moe = K.MoEKernel(pool, backend, E, H, I, g, u, d, t, t, t)

    def route(n):
        ids = np.stack([rng.permutation(E)[:k] for _ in range(n)]).astype(np.int64)
        return ids, rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)

    x = rng.standard_normal((4, H)).astype(np.float32)
    ids, w = route(4)
    alone = np.concatenate([moe.forward(x[i:i + 1], ids[i:i + 1], w[i:i + 1]) for i in range(4)])
    for n in BATCHES:
        ox = rng.standard_normal((n, H)).astype(np.float32)
        oi, ow = route(n)
        pos = rng.choice(n, size=min(4, n), replace=False)
        ox[pos], oi[pos], ow[pos] = x[:len(pos)], ids[:len(pos)], w[:len(pos)]
        y = moe.forward(ox, oi, ow)
        for j, p in enumerate(pos):
            assert np.array_equal(y[p], alone[j]), f"MoE {backend} {t.name}: token alone != in a batch of {n}"
