"""Causal prompt attention (kernels.flash_attention, csrc/flash_attn_avx512.inc on AVX-512 -- bf16
P x V from AVX512-BF16 up --, csrc/flash_attn_avx2.cpp on AVX2) against float64 softmax attention on the same q / k / v; the
paged form (kernels.flash_attention_paged, keys scattered over a page pool) bitwise against it.

Tolerances (||out - ref|| / ||ref||): 1e-5 fp32 (measured 1e-7 .. 4e-7); 5e-3 with ``bf16_pv``
(probabilities and values rounded to bf16; measured 1.7e-3 .. 2.2e-3; below AVX512-BF16 the kernels keep fp32).  Shapes cover 1 and 7
tokens, GQA group sizes 1 / 4 / 8, head sizes 64 / 128 / 256, a chunk after a cached prefix, a
sliding window, key blocks that end partial, and 4096 / 16384 tokens (the long ones against
reference rows sampled across the prompt).
"""

from __future__ import annotations

import pytest
import torch

import ktransformers.kernels as K
from conftest import QUICK

pytestmark = pytest.mark.skipif(not K.flash_attention_supported(),
                                 reason="the CPU tier in force has no AVX2 + FMA (torch's sdpa serves it)")
TOL = {False: 1e-5, True: 5e-3}


@pytest.fixture(scope="module")
def pool():
    return K.cpu_infer(2)


def reference(q, k, v, start, scale, window, rows=None):
    """float64 attention of the query rows ``rows`` (default all) of q [1, H, T, D]."""
    _, H, T, D = q.shape
    G = H // k.shape[1]
    rows = torch.arange(T) if rows is None else rows
    end = start + T
    kk = k[0, :, :end].double().repeat_interleave(G, 0)  # [H, end, D]
    vv = v[0, :, :end].double().repeat_interleave(G, 0)
    s = torch.einsum("htd,hjd->htj", q[0, :, rows].double(), kk) * scale
    pos = (start + rows)[:, None]
    j = torch.arange(end)[None, :]
    ok = j <= pos
    if window:
        ok &= j > pos - window
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
    return torch.einsum("htj,hjd->thd", p, vv)  # [rows, H, D]


def make(H, Hkv, T, D, start, slack=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g).transpose(1, 2)  # [1, H, T, D] strided as transformers' views
    S = start + T + slack
    k = torch.randn(1, Hkv, S, D, generator=g)
    v = torch.randn(1, Hkv, S, D, generator=g)
    k[:, :, start + T:] = float("nan")  # slots past the written keys are never read
    v[:, :, start + T:] = float("nan")
    return q, k, v


@pytest.mark.parametrize("bf16_pv", [False, True])
@pytest.mark.parametrize("H,Hkv,T,D,start,window", [
    (8, 8, 1, 64, 0, 0), (32, 4, 1, 128, 77, 0), (32, 4, 7, 128, 0, 0), (16, 2, 33, 256, 5, 0),
    (8, 1, 100, 128, 130, 0), (4, 4, 200, 64, 10, 50), (4, 2, 97, 128, 0, 64), (2, 1, 300, 64, 0, 0)])
def test_flash_attention_matches_float64(pool, H, Hkv, T, D, start, window, bf16_pv):
    q, k, v = make(H, Hkv, T, D, start)
    scale = D ** -0.5
    out = K.flash_attention(pool, q, k, v, start, scale, window, bf16_pv=bf16_pv)
    ref = reference(q, k, v, start, scale, window)
    err = ((out[0].double() - ref).norm() / ref.norm()).item()
    assert err < TOL[bf16_pv], f"rel err {err:.3g}"


@pytest.mark.parametrize("T,start", [(4096, 0), (2048, 3000)] + ([] if QUICK else [(16384, 0)]))
def test_flash_attention_long_prompts(pool, T, start):
    H, Hkv, D = 4, 1, 64
    q, k, v = make(H, Hkv, T, D, start, seed=T)
    out = K.flash_attention(pool, q, k, v, start, 0.125)
    rows = torch.unique(torch.cat([torch.arange(0, T, max(1, T // 40)), torch.tensor([1, 63, 64, 65, T - 1])]))
    ref = reference(q, k, v, start, 0.125, 0, rows)
    err = ((out[0, rows].double() - ref).norm() / ref.norm()).item()
    assert err < TOL[False], f"rel err {err:.3g}"


def test_flash_attention_bad_arguments(pool):
    q, k, v = make(4, 3, 5, 64, 0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        K.flash_attention(pool, q, k, v, 0, 0.1)
    q, k, v = make(4, 2, 5, 48, 0)
    with pytest.raises(ValueError, match="multiple of 64"):
        K.flash_attention(pool, q, k, v, 0, 0.1)
    q, k, v = make(4, 2, 5, 64, 0, slack=0)
    with pytest.raises(ValueError, match="keys 5 >= start 1"):
        K.flash_attention(pool, q, k, v, 1, 0.1)
    with pytest.raises(ValueError, match="q must be float32"):
        K.flash_attention(pool, q.double(), k, v, 0, 0.1)


@pytest.mark.parametrize("bf16_pv", [False, True])
@pytest.mark.parametrize("H,Hkv,T,D,start,window,page_size", [(8, 2, 70, 128, 0, 0, 16), (4, 1, 33, 256, 200, 0, 4),
                                                               (6, 3, 50, 64, 300, 96, 32)])
def test_paged_flash_attention_is_the_same_bits_as_over_a_cache(pool, H, Hkv, T, D, start, window, page_size, bf16_pv):
    """The batching server's prompt chunks read their keys through a block table; a sequence's
    keys scattered over a page pool (beside other sequences' rows) give exactly the bits of the
    same keys in a cache tensor (the single-sequence routes)."""
    q, k, v = make(H, Hkv, T, D, start, seed=T + D)
    want = K.flash_attention(pool, q, k, v, start, D ** -0.5, window, bf16_pv=bf16_pv)
    g = torch.Generator().manual_seed(D)
    n = start + T
    n_pages = -(-n // page_size)
    perm = torch.randperm(n_pages + 5, generator=g)
    table = perm[:n_pages].to(torch.int64).contiguous()
    slots = (n_pages + 5) * page_size
    keys, values = torch.randn(slots, Hkv, D, generator=g), torch.randn(slots, Hkv, D, generator=g)
    j = torch.arange(n)
    at = table[j // page_size] * page_size + j % page_size
    keys[at] = k[0, :, :n].transpose(0, 1)
    values[at] = v[0, :, :n].transpose(0, 1)
    out = K.flash_attention_paged(pool, q, keys, values, table, page_size, start, D ** -0.5, window, bf16_pv=bf16_pv)
    assert torch.equal(out, want)


def test_paged_flash_attention_refuses_a_bad_block_table(pool):
    q, k, v = make(4, 1, 10, 64, 0)
    keys = torch.zeros(32, 1, 64)
    with pytest.raises(ValueError, match="block table must cover"):
        K.flash_attention_paged(pool, q, keys, keys.clone(), torch.zeros(1, dtype=torch.int64), 4, 0, 0.1)
    with pytest.raises(ValueError, match="outside the pool's 8 pages"):  # 32 slots of 4: pages 0 .. 7
        K.flash_attention_paged(pool, q, keys, keys.clone(), torch.tensor([0, 8, 1], dtype=torch.int64), 4, 0, 0.1)
    with pytest.raises(ValueError, match="outside the pool"):
        K.flash_attention_paged(pool, q, keys, keys.clone(), torch.tensor([0, -1, 1], dtype=torch.int64), 4, 0, 0.1)


@pytest.mark.parametrize("bf16_pv", [False, True])
def test_a_rolled_window_is_the_same_bits_as_the_whole_cache(pool, bf16_pv):
    """A sliding layer that rolled holds positions key_first .. only: the chunk's attention over
    them equals the one over a cache holding every position (keys before the window never count)."""
    H, Hkv, T, D, start, window = 8, 2, 20, 64, 150, 48
    q, k, v = make(H, Hkv, T, D, start, seed=11)
    want = K.flash_attention(pool, q, k, v, start, D ** -0.5, window, bf16_pv=bf16_pv)
    first = start - window + 1
    rolled_k, rolled_v = k[:, :, first:start + T].contiguous(), v[:, :, first:start + T].contiguous()
    got = K.flash_attention(pool, q, rolled_k, rolled_v, start, D ** -0.5, window, bf16_pv=bf16_pv, key_first=first)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="key_first"):  # a visible key missing
        K.flash_attention(pool, q, rolled_k[:, :, 1:], rolled_v[:, :, 1:], start, D ** -0.5, window, key_first=first + 1)


def test_paged_flash_attention_fuzzed_block_tables(pool):
    """Any block table: a page id outside the pool is a ValueError naming it, never a read outside
    the pool; a valid one gives the bits of the same keys gathered into a cache."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    q, k, v = make(4, 1, 6, 64, 2, seed=5)
    ps, n_pages = 4, 6
    keys, values = torch.randn(n_pages * ps, 1, 64), torch.randn(n_pages * ps, 1, 64)

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(-3, n_pages + 3), min_size=2, max_size=4))
    def check(ids):
        table = torch.tensor(ids, dtype=torch.int64)
        if any(not 0 <= i < n_pages for i in ids[:2]):  # 8 keys: the first two pages are read
            with pytest.raises(ValueError, match="outside the pool"):
                K.flash_attention_paged(pool, q, keys, values, table, ps, 2, 0.125)
            return
        out = K.flash_attention_paged(pool, q, keys, values, table, ps, 2, 0.125)
        j = torch.arange(8)
        at = table[j // ps] * ps + j % ps
        kc, vc = keys[at].transpose(0, 1)[None], values[at].transpose(0, 1)[None]
        assert torch.equal(out, K.flash_attention(pool, q, kc, vc, 2, 0.125))

    check()
