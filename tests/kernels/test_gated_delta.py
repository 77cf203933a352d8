"""Gated-DeltaNet linear attention kernels (``kernels.attention.causal_conv_silu`` /
``gated_delta_rule``, csrc/decode_ops.cpp), against transformers' own torch functions.

References: transformers' ``torch_recurrent_gated_delta_rule`` (the same math token by token:
within 2e-5 x max|out|, fp32 sums of dk and dv <= 128 in another order) and its chunked
``torch_chunk_gated_delta_rule`` (the same recurrence regrouped into 64-token matmuls: 1e-4), and
``causal_conv1d_fn`` (F.conv1d + SiLU: 1e-6).  Invariance, bitwise: a sequence cut into chunks of
any size (the state and the conv window carried between them) gives the outputs and the state of
the whole, at 1 and 2 pool threads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as M

from ktransformers.kernels.attention import causal_conv_silu, gated_delta_rule
from ktransformers.kernels.pool import cpu_infer

SHAPES = [  # (hk, hv, dk, dv)
    (2, 4, 16, 16),
    (1, 1, 64, 32),
    (4, 8, 128, 128),  # Qwen3-Next-80B's heads of 128, fewer of them
]


def _inputs(T, hk, hv, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, 2 * hk * dk + hv * dv, generator=g)
    b = torch.randn(T, hv, generator=g)
    a = torch.randn(T, hv, generator=g) * 2
    A_log = torch.log(torch.rand(hv, generator=g) * 15 + 0.5)
    dt_bias = torch.randn(hv, generator=g)
    return qkv, b, a, A_log, dt_bias


def _split(qkv, hk, hv, dk, dv):
    T = qkv.shape[0]
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    return q.reshape(1, T, hk, dk), k.reshape(1, T, hk, dk), v.reshape(1, T, hv, dv)


def _hf(fn, qkv, b, a, A_log, dt_bias, hk, hv, dk, dv, state=None):
    q, k, v = _split(qkv, hk, hv, dk, dv)
    beta = b.sigmoid()[None]
    g = (-A_log.exp() * F.softplus(a + dt_bias))[None]
    out, st = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], st[0]


def _ours(pool, qkv, b, a, A_log, dt_bias, hk, hv, dk, dv, state=None):
    s = torch.zeros(hv, dk, dv) if state is None else state.clone()
    return gated_delta_rule(pool, qkv.contiguous(), b, a, A_log, dt_bias, s, hk, dk), s


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
@pytest.mark.parametrize("T", [1, 7, 150])
def test_delta_rule_matches_transformers(hk, hv, dk, dv, T):
    pool = cpu_infer(2)
    x = _inputs(T, hk, hv, dk, dv)
    out, st = _ours(pool, *x, hk, hv, dk, dv)
    for fn, tol in ((M.torch_recurrent_gated_delta_rule, 2e-5), (M.torch_chunk_gated_delta_rule, 1e-4)):
        ref, ref_st = _hf(fn, *x, hk, hv, dk, dv)
        scale = ref.abs().max()
        assert (out - ref).abs().max() <= tol * scale, fn.__name__
        assert (st - ref_st).abs().max() <= tol * ref_st.abs().max(), fn.__name__
    # from a state: the second half after the first
    half = T // 2
    if half:
        _, s1 = _ours(pool, *(t[:half] if t.dim() == 2 else t for t in x), hk, hv, dk, dv)
        rest = tuple(t[half:] if t.dim() == 2 else t for t in x)
        out2, _ = _ours(pool, *rest, hk, hv, dk, dv, state=s1)
        ref2, _ = _hf(M.torch_recurrent_gated_delta_rule, *rest, hk, hv, dk, dv, state=s1[None])
        assert (out2 - ref2).abs().max() <= 2e-5 * ref2.abs().max()


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_delta_rule_chunks_give_the_same_bits(hk, hv, dk, dv, threads):
    pool = cpu_infer(threads)
    T = 70
    x = _inputs(T, hk, hv, dk, dv, seed=1)
    whole, s_whole = _ours(cpu_infer(2), *x, hk, hv, dk, dv)
    for chunk in (1, 7, 64):
        s = torch.zeros(hv, dk, dv)
        outs = []
        for t0 in range(0, T, chunk):
            part = tuple(t[t0:t0 + chunk] if t.dim() == 2 else t for t in x)
            qkv, b, a, A_log, dt_bias = part
            outs.append(gated_delta_rule(pool, qkv.contiguous(), b.contiguous(), a.contiguous(), A_log, dt_bias, s,
                                         hk, dk))
        assert torch.equal(torch.cat(outs), whole), f"chunks of {chunk}"
        assert torch.equal(s, s_whole), f"chunks of {chunk}: state"


@pytest.mark.parametrize("C,K", [(128, 4), (8192, 4), (96, 2)])
def test_conv_matches_transformers_and_chunks(C, K):
    pool = cpu_infer(2)
    g = torch.Generator().manual_seed(2)
    T = 37
    x = torch.randn(C, T, generator=g)
    w = torch.randn(C, K, generator=g) * 0.5
    ref = M.causal_conv1d_fn(x[None], w, None, activation="silu")[0].T
    ours = causal_conv_silu(pool, F.pad(x, (K - 1, 0)).contiguous(), w, T)
    assert (ours - ref).abs().max() <= 1e-6 * ref.abs().max()
    # one output at a time from a window of the last K inputs: the same bits
    xp = F.pad(x, (K - 1, 0))
    for t in (0, 5, T - 1):
        one = causal_conv_silu(pool, xp[:, t:t + K].contiguous(), w, 1)
        assert torch.equal(one[0], ours[t])


def test_bad_shapes_are_named():
    pool = cpu_infer(1)
    qkv, b, a, A_log, dt_bias = _inputs(3, 2, 4, 16, 16)
    with pytest.raises(ValueError, match="key heads"):
        gated_delta_rule(pool, qkv, b, a, A_log, dt_bias, torch.zeros(4, 16, 8), 2, 16)
    with pytest.raises(ValueError, match="b must be float32"):
        gated_delta_rule(pool, qkv, b[:2], a, A_log, dt_bias, torch.zeros(4, 16, 16), 2, 16)
    with pytest.raises(ValueError, match="dt_bias"):
        gated_delta_rule(pool, qkv, b, a, A_log, dt_bias[:3], torch.zeros(4, 16, 16), 2, 16)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_rule(pool, qkv, b, a, A_log, dt_bias, torch.zeros(4, 16, 16, dtype=torch.float64), 2, 16)
    with pytest.raises(ValueError, match="cannot give"):
        causal_conv_silu(pool, torch.zeros(8, 4), torch.zeros(8, 4), 2)
    with pytest.raises(ValueError, match="does not match"):
        causal_conv_silu(pool, torch.zeros(8, 8), torch.zeros(4, 4), 2)
