"""Causal prompt attention (kernels.flash_attention, csrc/flash_attn.cpp) against float64 softmax
attention on the same q / k / v.

Tolerances (||out - ref|| / ||ref||): 1e-5 fp32 (measured 1e-7 .. 4e-7); 5e-3 with ``bf16_pv``
(probabilities and values rounded to bf16; measured 1.7e-3 .. 2.2e-3).  Shapes cover 1 and 7
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
                                 reason="the CPU tier in force has no AVX512-BF16 (torch's sdpa serves it)")
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
