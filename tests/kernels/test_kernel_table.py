"""The per-type kernel table of the ISA tier in force (``cpuinfer_ext.kernel_rows()``): every
llamafile weight type has a row, and from the avx2 tier on no type is left to the generic
dequantise-then-dot fallback.  Also checks the token-tile widths the decode/prefill kernels
switch between (T = 2, 5, 6, 7, 17: partial 4-token tiles) on odd row counts."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from conftest import TIERS
from quant_ref import ALL_TYPES, block_elems, make_weights
from ref import rel_err

import ktransformers.cpuinfer_ext as ext
import ktransformers.kernels as K

ACT = {"f32", "bf16", "q8_32", "q8_256"}


def test_every_type_has_a_row():
    rows = ext.kernel_rows()
    for t in ALL_TYPES:
        assert t.name in rows, f"{t.name} missing from the kernel table of {K.isa_tier()}"
        decode, prefill, act = rows[t.name]
        assert decode and prefill and act in ACT, (t.name, rows[t.name])


def test_no_generic_fallback_from_avx2_on():
    tier = K.isa_tier()
    rows = ext.kernel_rows()
    if TIERS.index(tier) < TIERS.index("avx2"):
        # the baseline tier has no SIMD kernels: everything is the generic path, and says so
        assert all(rows[t.name][:2] == ("generic", "generic") for t in ALL_TYPES), rows
        return
    generic = {n: r for n, r in rows.items() if "generic" in r[:2]}
    assert not generic, f"tier {tier}: types served by the generic fallback: {generic}"


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_partial_token_tiles(pool, t):
    """13 rows (a partial 4-row tile) against float64; a 1-row matrix (all of its tile is the
    repeated last row) must give that row's values of the 13-row one."""
    n_in = 512 if block_elems(t) == 256 else 288  # 288 = 9 blocks of 32: one full + one partial chunk of 8
    rng = np.random.default_rng(int(t))
    raw, deq = make_weights(t, (13, n_in), rng)
    lin = K.LinearKernel(pool, "llamafile", n_in, 13, raw, t)
    lin1 = K.LinearKernel(pool, "llamafile", n_in, 1, np.ascontiguousarray(raw[:1]), t)
    tol = 1e-4 if t in (QT.F32, QT.F16) else (1e-2 if t == QT.BF16 else 2e-2)
    for T in (2, 5, 6, 7, 17):
        x = rng.standard_normal((T, n_in)).astype(np.float32)
        y = lin.forward(x)
        err = rel_err(y, x.astype(np.float64) @ deq.T.astype(np.float64))
        assert err < tol, f"{t.name} {n_in}x13 T={T}: rel err {err:.3g}"
        np.testing.assert_allclose(lin1.forward(x), y[:, :1], rtol=1e-5, atol=1e-6 * np.abs(y).max())
