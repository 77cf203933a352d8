"""MLA attention in latent space (kernels.mla_attention, csrc/flash_attn.cpp): against a float64
reference of the same maths (the absorbed form of DeepSeek's attention), and bitwise against
itself read in other ways -- whole, in chunks of 1 / 7 / 64 rows, as one decode row after another,
over a page pool, on one thread or two.

Tolerance (||out - ref|| / ||ref||): 2e-5 (fp32 products and sums over up to 4096 keys; measured
~1e-7 .. 5e-7).  Shapes: a small one (4 heads, latent 64, rope 16) and DeepSeek-V2-Lite's (16 heads,
nope 128, rope 64, latent 512, v 128), 1 / 7 / 300 rows, after a cached prefix, 4096 keys.
"""

from __future__ import annotations

import pytest
import torch

import ktransformers.kernels as K
from conftest import QUICK

pytestmark = pytest.mark.skipif(not K.flash_attention_supported(),
                                 reason="the CPU tier in force has no AVX2 + FMA")
SMALL = dict(H=4, nope=16, R=16, C=64, v=32)
LITE = dict(H=16, nope=128, R=64, C=512, v=128)
TOL = 2e-5


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


def make(H, nope, R, C, v, S, T, seed=0):
    """(q_nope [T, H, nope], q_pe [T, H, R], latent [S + 3, C], rope_key [S + 3, R], w_uk, w_uv_t);
    the queries strided as the attention's views of one [T, H, nope + R] projection."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, nope + R, generator=g)
    lat = torch.randn(S + 3, C, generator=g)
    rk = torch.randn(S + 3, R, generator=g)
    lat[S:] = float("nan")  # slots past the written keys are never read
    rk[S:] = float("nan")
    w_uk = torch.randn(H, nope, C, generator=g) * nope ** -0.5
    w_uv_t = torch.randn(H, C, v, generator=g) * C ** -0.5
    return q[..., :nope], q[..., nope:], lat, rk, w_uk, w_uv_t


def reference(q_nope, q_pe, lat, rk, w_uk, w_uv_t, start, scale):
    """float64: q = [q_nope W_UK | q_pe], causal softmax over [c | r], (sum p c) W_UV^T."""
    T = q_nope.shape[0]
    end = start + T
    qa = torch.einsum("thn,hnc->thc", q_nope.double(), w_uk.double())
    s = (torch.einsum("thc,jc->thj", qa, lat[:end].double())
         + torch.einsum("thr,jr->thj", q_pe.double(), rk[:end].double())) * scale
    ok = torch.arange(end)[None, :] <= (start + torch.arange(T))[:, None]
    p = torch.softmax(s.masked_fill(~ok[:, None, :], float("-inf")), -1)
    return torch.einsum("thc,hcv->thv", torch.einsum("thj,jc->thc", p, lat[:end].double()), w_uv_t.double())


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


CASES = [(SMALL, 1, 0), (SMALL, 7, 0), (SMALL, 7, 250), (SMALL, 300, 0), (LITE, 1, 0), (LITE, 7, 300),
         (LITE, 70, 0)] + ([] if QUICK else [(LITE, 1, 4095), (SMALL, 64, 4032)])


@pytest.mark.parametrize("shape,T,start", CASES)
def test_matches_float64(pool, shape, T, start):
    qn, qp, lat, rk, w_uk, w_uv_t = make(**shape, S=start + T, T=T)
    scale = 0.7 * (shape["nope"] + shape["R"]) ** -0.5
    got = K.mla_attention(pool, qn, qp, lat, rk, w_uk, w_uv_t, start, scale)
    assert got.shape == (T, shape["H"], shape["v"])
    err = _rel(got, reference(qn, qp, lat, rk, w_uk, w_uv_t, start, scale))
    assert err < TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("shape", [SMALL, LITE], ids=["small", "lite"])
def test_a_row_has_one_set_of_bits_however_it_is_read(pool, shape):
    """The same rows whole, in chunks of 7 and 64 after cached prefixes, as decode rows (one at a
    time), over a page pool in scattered pages, and on one thread: torch.equal throughout."""
    T = 300
    qn, qp, lat, rk, w_uk, w_uv_t = make(**shape, S=T, T=T, seed=1)
    scale = (shape["nope"] + shape["R"]) ** -0.5
    whole = K.mla_attention(pool, qn, qp, lat, rk, w_uk, w_uv_t, 0, scale)
    for chunk in (1, 7, 64):
        if chunk == 1 and shape is LITE and QUICK:
            continue
        parts = [K.mla_attention(pool, qn[s:s + chunk], qp[s:s + chunk], lat, rk, w_uk, w_uv_t, s, scale)
                 for s in range(0, T, chunk)]
        assert torch.equal(torch.cat(parts), whole), f"chunks of {chunk} differ from the whole prompt"
    ps = 16  # the keys in a page pool, pages in reverse order
    n_pages = -(-T // ps)
    table = torch.arange(n_pages, dtype=torch.int64).flip(0).contiguous()
    lat_pool = torch.full((n_pages * ps, shape["C"]), float("nan"))
    rk_pool = torch.full((n_pages * ps, shape["R"]), float("nan"))
    for j in range(T):
        slot = int(table[j // ps]) * ps + j % ps
        lat_pool[slot], rk_pool[slot] = lat[j], rk[j]
    paged = K.mla_attention(pool, qn, qp, lat_pool, rk_pool, w_uk, w_uv_t, 0, scale, table=table, page_size=ps)
    assert torch.equal(paged, whole), "a page pool gives other bits than the cache"
    one = K.cpu_infer(1)
    assert torch.equal(K.mla_attention(one, qn, qp, lat, rk, w_uk, w_uv_t, 0, scale), whole), "1 thread differs"


def test_writes_into_out_and_checks_its_input(pool):
    qn, qp, lat, rk, w_uk, w_uv_t = make(**SMALL, S=9, T=9)
    out = torch.empty(9, SMALL["H"], SMALL["v"])
    got = K.mla_attention(pool, qn, qp, lat, rk, w_uk, w_uv_t, 0, 0.1, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert K.mla_attention_supported(512, 64) and not K.mla_attention_supported(32, 8)
    with pytest.raises(ValueError, match="latent width 32"):
        K.mla_attention(pool, qn, qp, lat[:, :32], rk, w_uk[..., :32], w_uv_t[:, :32], 0, 0.1)
    with pytest.raises(ValueError, match="cached keys"):
        K.mla_attention(pool, qn, qp, lat[:5], rk[:5], w_uk, w_uv_t, 0, 0.1)
    with pytest.raises(ValueError, match="float32"):
        K.mla_attention(pool, qn.double(), qp, lat, rk, w_uk, w_uv_t, 0, 0.1)
    with pytest.raises(ValueError, match="block table"):
        K.mla_attention(pool, qn, qp, lat, rk, w_uk, w_uv_t, 0, 0.1, table=torch.zeros(1, dtype=torch.int64),
                        page_size=4)
    with pytest.raises(ValueError, match="shapes disagree"):
        K.mla_attention(pool, qn, qp[:3], lat, rk, w_uk, w_uv_t, 0, 0.1)


def test_fuzz_widths_lengths_and_tables(pool):
    """Any latent / rope width, row count, start, cache length and block table: a result within the
    tolerance of the float64 reference, or a ValueError that names the problem -- never a crash."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(st.sampled_from([32, 64, 96, 128, 576]), st.sampled_from([4, 8, 16, 12]), st.integers(1, 9),
           st.integers(0, 40), st.integers(-2, 3), st.one_of(st.none(), st.lists(st.integers(-1, 12), max_size=14)))
    def check(C, R, T, start, slack, pages):
        S = max(1, start + T + slack)
        qn, qp, lat, rk, w_uk, w_uv_t = make(H=2, nope=8, R=R, C=C, v=16, S=S, T=T, seed=7)
        lat, rk = lat[:S], rk[:S]
        table, ps = (None, 0) if pages is None else (torch.tensor(pages, dtype=torch.int64), 4)
        try:
            got = K.mla_attention(pool, qn, qp, lat, rk, w_uk, w_uv_t, start, 0.3, table=table, page_size=ps)
        except ValueError as e:
            msg = str(e)
            assert msg.startswith("mla_attention: ") and "\n" not in msg
            assert (not K.mla_attention_supported(C, R) or "cached keys" in msg or "block table" in msg), msg
            return
        assert K.mla_attention_supported(C, R)
        if table is not None:  # the keys through the table's slots
            j = torch.arange(start + T)
            at = table[j // ps] * ps + j % ps
            lat, rk = lat[at], rk[at]
        assert _rel(got, reference(qn, qp, lat, rk, w_uk, w_uv_t, start, 0.3)) < TOL

    check()
