"""The decode step's attention (``cpuinfer_ext.decode_ops.attend``): one query token over a cache.

Reference: softmax(q K^T * scale) V in float64 torch, GQA by repeating kv heads.  Tolerance: 2e-6
x max|out| + 1e-6 (fp32 dots of d <= 256 and an exp2 polynomial of relative error < 2e-7).
The entries are split into fixed chunks of 256 keys, merged in order: the output is bitwise the
same for 1 and 2 pool threads.  The write half (slot, roll, the length counter) is checked exactly.
"""

from __future__ import annotations

import pytest
import torch

from ktransformers import cpuinfer_ext as ext
from ktransformers.kernels.pool import cpu_infer

ops = ext.decode_ops


def _run(pool, q, k_new, v_new, K, V, slot, roll, n, scale, length=None):
    hq, d = q.shape
    hkv, cap = K.shape[0], K.shape[1]
    out = torch.empty(hq, d)
    ops.attend(pool._c, q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), K.data_ptr(), V.data_ptr(), hq, hkv, d,
               cap, slot, roll, n, scale, 0 if length is None else length.data_ptr(), out.data_ptr())
    return out


def _ref(q, K, V, n, scale):
    hq, d = q.shape
    hkv = K.shape[0]
    k = K[:, :n].double().repeat_interleave(hq // hkv, dim=0)
    v = V[:, :n].double().repeat_interleave(hq // hkv, dim=0)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q.double(), k) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", p, v).float()


@pytest.mark.parametrize("hq,hkv,d", [(32, 4, 128), (4, 1, 256), (8, 8, 64), (6, 2, 72)])
@pytest.mark.parametrize("n", [1, 7, 256, 257, 1000, 4096])
def test_attend_matches_softmax_attention(hq, hkv, d, n):
    g = torch.Generator().manual_seed(n * 7 + d)
    cap = n + 3
    K, V = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    q = torch.randn(hq, d, generator=g) * 2
    k_new, v_new = torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    length = torch.tensor(n - 1, dtype=torch.int64)
    scale = d ** -0.5
    out = _run(cpu_infer(2), q, k_new, v_new, K, V, n - 1, 0, n, scale, length)
    assert torch.equal(K[:, n - 1], k_new) and torch.equal(V[:, n - 1], v_new)
    assert int(length) == n
    want = _ref(q, K, V, n, scale)
    err = (out - want).abs().max().item()
    assert err <= 2e-6 * want.abs().max().item() + 1e-6, f"max error {err:.3e}"


@pytest.mark.parametrize("n", [300, 5000])
def test_attend_is_the_same_for_any_thread_count(n):
    g = torch.Generator().manual_seed(n)
    hq, hkv, d, cap = 16, 2, 128, n
    K, V = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    q, kn, vn = torch.randn(hq, d, generator=g), torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    one = _run(cpu_infer(1), q, kn, vn, K.clone(), V.clone(), n - 1, 0, n, 0.1)
    two = _run(cpu_infer(2), q, kn, vn, K.clone(), V.clone(), n - 1, 0, n, 0.1)
    assert torch.equal(one, two)


def test_attend_roll_shifts_a_full_window():
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, cap = 4, 2, 64, 9
    K, V = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    K0, V0 = K.clone(), V.clone()
    q, kn, vn = torch.randn(hq, d, generator=g), torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    out = _run(cpu_infer(2), q, kn, vn, K, V, 0, 1, cap, 0.125)
    assert torch.equal(K[:, :-1], K0[:, 1:]) and torch.equal(K[:, -1], kn)
    assert torch.equal(V[:, :-1], V0[:, 1:]) and torch.equal(V[:, -1], vn)
    want = _ref(q, K, V, cap, 0.125)
    assert (out - want).abs().max().item() <= 2e-6 * want.abs().max().item() + 1e-6


def test_attend_refuses_bad_shapes():
    q, K = torch.zeros(6, 64), torch.zeros(4, 8, 64)
    with pytest.raises(ValueError, match="hq % hkv"):
        _run(cpu_infer(1), q, torch.zeros(4, 64), torch.zeros(4, 64), K, K.clone(), 0, 0, 1, 1.0)
    with pytest.raises(ValueError, match="n <= cap"):
        _run(cpu_infer(1), torch.zeros(8, 64), torch.zeros(4, 64), torch.zeros(4, 64), K, K.clone(), 0, 0, 9, 1.0)
