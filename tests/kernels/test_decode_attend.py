"""The decode step's attention (``cpuinfer_ext.decode_ops.attend_rows``): one query token per row over
a cache layer (``[hkv, cap, d]``, the transformers caches of the single-sequence routes) or over a
page pool (``[slots, hkv, d]``, continuous batching).

Reference: softmax(q K^T * scale) V in float64 torch, GQA by repeating kv heads.  Tolerance: 2e-6
x max|out| + 1e-6 (fp32 dots of d <= 256 and an exp2 polynomial of relative error < 2e-7).
Invariance, bitwise: a row's keys are cut into chunks of 256 at absolute positions and merged in
order, so the output is the same for 1 and 2 pool threads, beside any other rows, and whether the
keys sit in a cache layer or scattered over pages.  The write half (slot, roll, the length
counter) is checked exactly.  RoPE is the identity here (cos 1, sin 0) and there is no q/k norm:
tests/generation/test_batch_decode_lean.py covers those.
"""

from __future__ import annotations

import pytest
import torch

from ktransformers import cpuinfer_ext as ext
from ktransformers.kernels.pool import cpu_infer

ops = ext.decode_ops
_NONE = torch.zeros(2, dtype=torch.int64)


def _qkv(q, k_new, v_new):
    return torch.cat([q.reshape(-1), k_new.reshape(-1), v_new.reshape(-1)])[None].contiguous()


def _layer(pool, q, k_new, v_new, K, V, pos, lo, scale, roll=0, length=None, bf16_pv=False):
    """One row over a cache layer K, V [hkv, cap, d] holding positions lo .. (slot = position - lo)."""
    hq, d = q.shape
    hkv, cap = K.shape[0], K.shape[1]
    qkv = _qkv(q, k_new, v_new)
    ones, zeros = torch.ones(1, d), torch.zeros(1, d)
    out = torch.empty(1, hq * d)
    p, l = torch.tensor([pos]), torch.tensor([lo])
    ops.attend_rows(pool._c, qkv.data_ptr(), 1, hq, hkv, d, 0, 0.0, ones.data_ptr(), zeros.data_ptr(), K.data_ptr(),
                    V.data_ptr(), d, cap * d, 0, _NONE.data_ptr(), _NONE.data_ptr(), p.data_ptr(), l.data_ptr(), roll,
                    cap, 0 if length is None else length.data_ptr(), scale, out.data_ptr(), bf16_pv=bf16_pv)
    return out.view(hq, d)


def _paged(pool, qs, ks, vs, keys, values, page_size, tables, positions, scale, window=0):
    """N rows over a page pool keys, values [slots, hkv, d]."""
    n, hq, d = len(qs), qs[0].shape[0], qs[0].shape[1]
    hkv = keys.shape[1]
    qkv = torch.cat([_qkv(q, k, v) for q, k, v in zip(qs, ks, vs)]).contiguous()
    ones, zeros = torch.ones(n, d), torch.zeros(n, d)
    pages = torch.tensor([p for t in tables for p in t], dtype=torch.int64)
    offs = torch.tensor([0] + torch.tensor([len(t) for t in tables]).cumsum(0).tolist(), dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
    out = torch.empty(n, hq * d)
    ops.attend_rows(pool._c, qkv.data_ptr(), n, hq, hkv, d, 0, 0.0, ones.data_ptr(), zeros.data_ptr(),
                    keys.data_ptr(), values.data_ptr(), hkv * d, d, page_size, pages.data_ptr(), offs.data_ptr(),
                    pos.data_ptr(), lo.data_ptr(), 0, 0, 0, scale, out.data_ptr())
    return out.view(n, hq, d)


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
    out = _layer(cpu_infer(2), q, k_new, v_new, K, V, n - 1, 0, scale, length=length)
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
    one = _layer(cpu_infer(1), q, kn, vn, K.clone(), V.clone(), n - 1, 0, 0.1)
    two = _layer(cpu_infer(2), q, kn, vn, K.clone(), V.clone(), n - 1, 0, 0.1)
    assert torch.equal(one, two)


def test_attend_roll_shifts_a_full_window():
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, cap = 4, 2, 64, 9
    K, V = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    K0, V0 = K.clone(), V.clone()
    q, kn, vn = torch.randn(hq, d, generator=g), torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    pos = 40  # the layer held positions 31 .. 39; after the roll 32 .. 40
    out = _layer(cpu_infer(2), q, kn, vn, K, V, pos, pos - cap + 1, 0.125, roll=1)
    assert torch.equal(K[:, :-1], K0[:, 1:]) and torch.equal(K[:, -1], kn)
    assert torch.equal(V[:, :-1], V0[:, 1:]) and torch.equal(V[:, -1], vn)
    want = _ref(q, K, V, cap, 0.125)
    assert (out - want).abs().max().item() <= 2e-6 * want.abs().max().item() + 1e-6


@pytest.mark.parametrize("d,hq,hkv", [(256, 4, 1), (128, 16, 4), (72, 6, 2)])
@pytest.mark.parametrize("window", [0, 300])
def test_a_row_is_the_same_bits_in_a_cache_layer_and_in_pages_beside_other_rows(d, hq, hkv, window):
    """The Generator's cache layer and the batching server's pages give a request the same bits:
    the same keys, once contiguous and once scattered over pages next to other sequences' rows."""
    g = torch.Generator().manual_seed(d + window)
    pos, S = 700, 16
    lo = max(0, pos - window + 1) if window else 0
    n_keys = pos + 1 - lo
    K, V = torch.randn(hkv, n_keys, d, generator=g), torch.randn(hkv, n_keys, d, generator=g)
    q, kn, vn = torch.randn(hq, d, generator=g), torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    alone = _layer(cpu_infer(2), q, kn, vn, K.clone(), V.clone(), pos, lo, 0.07)

    # the same sequence's positions 0 .. pos on shuffled pages; two other rows beside it
    others = [(37, torch.randn(hq, d, generator=g)), (1200, torch.randn(hq, d, generator=g))]
    need = [pos // S + 1] + [p // S + 1 for p, _ in others]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(perm[at:at + k])
        at += k
    slots = (sum(need) + 3) * S
    keys, values = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    for p in range(lo, pos):
        s = tables[0][p // S] * S + p % S
        keys[s], values[s] = K[:, p - lo], V[:, p - lo]
    qs = [q] + [oq for _, oq in others]
    ks = [kn] + [torch.randn(hkv, d, generator=g) for _ in others]
    vs = [vn] + [torch.randn(hkv, d, generator=g) for _ in others]
    for threads in (1, 2):
        for order in ([0, 1, 2], [2, 0, 1]):
            out = _paged(cpu_infer(threads), [qs[i] for i in order], [ks[i] for i in order], [vs[i] for i in order],
                         keys.clone(), values.clone(), S, [tables[i] for i in order],
                         [pos if i == 0 else others[i - 1][0] for i in order], 0.07, window)
            assert torch.equal(out[order.index(0)], alone), f"threads {threads}, order {order}"


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (4, 1, 256), (32, 4, 128), (6, 6, 64), (16, 1, 64)])
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("bf16_pv", [False, True])
def test_a_decode_row_gives_the_prompt_kernels_bits(hq, hkv, d, window, bf16_pv):
    """A token decoded gives the bits the prompt flash kernel gives the same token in a prompt (same
    tier, same P x V precision), for rows on both sides of chunk boundaries (256, 512) and of the
    64-key blocks, with and without a sliding window -- so the K/V that later layers write for an
    answer's tokens are those a prompt read of the same text writes."""
    from ktransformers.kernels import flash_attention, flash_attention_supported

    if not flash_attention_supported():
        pytest.skip("no prompt flash kernel on this tier")
    g = torch.Generator().manual_seed(hq * 31 + d + window)
    T = 600
    q = torch.randn(1, hq, T, d, generator=g) * 2
    k, v = torch.randn(1, hkv, T, d, generator=g), torch.randn(1, hkv, T, d, generator=g)
    scale = d ** -0.5
    want = flash_attention(cpu_infer(2), q, k, v, 0, scale, window, bf16_pv=bf16_pv)[0]  # [T, H, D]
    for t in (0, 1, 63, 64, 99, 100, 255, 256, 257, 300, 511, 512, 599):
        lo = max(0, t - window + 1) if window else 0
        K, V = k[0, :, lo : t + 1].clone(), v[0, :, lo : t + 1].clone()  # positions lo .. t; t written by the row
        got = _layer(cpu_infer(2), q[0, :, t], k[0, :, t], v[0, :, t], K, V, t, lo, scale, bf16_pv=bf16_pv)
        assert torch.equal(got, want[t]), f"row {t}: max {(got - want[t]).abs().max():.3g}"


def test_attend_refuses_bad_shapes():
    K = torch.zeros(4, 8, 64)
    with pytest.raises(ValueError, match="hq % hkv"):
        _layer(cpu_infer(1), torch.zeros(6, 64), torch.zeros(4, 64), torch.zeros(4, 64), K, K.clone(), 0, 0, 1.0)
    with pytest.raises(ValueError, match="pos - lo < cap"):
        _layer(cpu_infer(1), torch.zeros(8, 64), torch.zeros(4, 64), torch.zeros(4, 64), K, K.clone(), 8, 0, 1.0)
    with pytest.raises(ValueError, match="lo <= pos"):
        _layer(cpu_infer(1), torch.zeros(8, 64), torch.zeros(4, 64), torch.zeros(4, 64), K, K.clone(), 2, 3, 1.0)
