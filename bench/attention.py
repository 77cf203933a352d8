"""Causal prompt attention: the project's flash kernel (fp32, and with bf16 P x V) next to torch's
own CPU flash kernel (``scaled_dot_product_attention(..., is_causal=True)``, fp32), one process,
same thread count, as ratios (torch ms / ours ms: > 1 means ours is faster).

Shapes: Qwen3-30B-A3B (32 query / 4 KV heads of 128) and Gemma-3-270M (4 / 1 of 256), one layer.

    .venv/bin/python bench/attention.py                       # 512, 2048, 8192 tokens, 2 threads
    .venv/bin/python bench/attention.py --tokens 4096,16384 --shapes qwen3
    .venv/bin/python bench/attention.py --decode 512,4096,32768   # one decode row at these depths

``--mla 512,2048``: DeepSeek-V2-Lite's multi-head latent attention (16 heads, latent 512, rope 64,
nope / v 128), one layer: the latent kernel (``kernels.mla_attention``: prompt rows, and one decode
row at that depth) next to the expanded form on torch's CPU flash kernel (keys and values expanded
by ``kv_b_proj``, then ``scaled_dot_product_attention``) and to the torch code the project ran
before (``mla.causal_prompt_attention``; the absorbed decode in torch).

``--decode``: the decode step's attention (``decode_ops.attend_rows``: one row over a cache layer of
that many keys, the q/k norm off, RoPE at the identity) next to torch's sdpa for one query, ms,
and the GB/s of keys and values it reads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ktransformers.kernels as K  # noqa: E402
from full_size import machine_line  # noqa: E402

SHAPES = {"qwen3": (32, 4, 128), "gemma3": (4, 1, 256)}


def best_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--shapes", default="qwen3,gemma3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode", default="", help="comma list of cache depths: time one decode row instead")
    ap.add_argument("--mla", default="", help="comma list of prompt lengths: DeepSeek-V2-Lite's MLA instead")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    pool = K.cpu_infer(a.threads)
    print(machine_line(None) + f", {a.threads} threads")
    if not K.flash_attention_supported():
        print("the ISA tier in force has no AVX2 + FMA: the flash kernel does not run here (torch's sdpa serves)")
        return 0
    if a.decode:
        return decode_rows(a, pool)
    if a.mla:
        return mla_rows(a, pool)
    print(f"{'shape':8} {'T':>6} {'torch ms':>9} {'ours ms':>8} {'bf16pv ms':>9} {'GFLOP/s':>8} "
          f"{'ours/torch':>10} {'bf16pv/torch':>12}")
    for name in a.shapes.split(","):
        H, Hkv, D = SHAPES[name]
        for T in (int(t) for t in a.tokens.split(",")):
            q = torch.randn(1, T, H, D).transpose(1, 2)
            k, v = torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
            scale = D ** -0.5
            tq = best_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=True), a.reps)
            out = torch.empty(1, T, H, D)
            t32 = best_ms(lambda: K.flash_attention(pool, q, k, v, 0, scale, out=out), a.reps)
            tbf = best_ms(lambda: K.flash_attention(pool, q, k, v, 0, scale, out=out, bf16_pv=True), a.reps)
            flops = 4 * H * D * T * (T + 1) / 2
            print(f"{name:8} {T:6d} {tq:9.1f} {t32:8.1f} {tbf:9.1f} {flops / t32 / 1e6:8.0f} "
                  f"{tq / t32:10.2f} {tq / tbf:12.2f}", flush=True)
    return 0


def mla_rows(a, pool) -> int:
    """DeepSeek-V2-Lite's MLA, one layer: a T-token prompt, then one decode row at depth T."""
    from ktransformers.operators.mla import causal_prompt_attention

    H, nope, R, C, v = 16, 128, 64, 512, 128
    scale = (nope + R) ** -0.5
    print(f"{'MLA V2-Lite':12} {'T':>6} {'torch ms':>9} {'before ms':>9} {'ours ms':>8} {'ours/torch':>10} "
          f"{'ours/before':>11} | {'dec before':>10} {'dec ours':>8} {'ratio':>6}")
    for T in (int(t) for t in a.mla.split(",")):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(T, H, nope + R, generator=g)
        qn, qp = q[..., :nope], q[..., nope:]
        lat, rk = torch.randn(T, C, generator=g), torch.randn(T, R, generator=g)
        kvb = torch.randn(H * (nope + v), C, generator=g) * C ** -0.5
        w3 = kvb.view(H, nope + v, C)
        w_uk, w_uv_t = w3[:, :nope].contiguous(), w3[:, nope:].transpose(1, 2).contiguous()
        out = torch.empty(T, H, v)

        def expanded():  # per-head keys / values by kv_b_proj, then torch's flash kernel
            kv = F.linear(lat, kvb).view(T, H, nope + v)
            k = torch.cat([kv[..., :nope], rk[:, None].expand(T, H, R)], -1).transpose(0, 1)[None]
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, kv[..., nope:].transpose(0, 1)[None],
                                                  is_causal=True, scale=scale)

        qn4, qp4 = qn.transpose(0, 1)[None], qp.transpose(0, 1)[None]
        tq = best_ms(expanded, a.reps)
        tb = best_ms(lambda: causal_prompt_attention(qn4, qp4, lat[None, None], rk[None, None], kvb, H, scale, 0),
                     a.reps)
        to = best_ms(lambda: K.mla_attention(pool, qn, qp, lat, rk, w_uk, w_uv_t, 0, scale, out=out), a.reps)
        q1n, q1p, o1 = qn[-1:], qp[-1:], out[-1:]

        def dec_before():  # the decode step's torch code before the kernel: absorbed, per head
            q_abs = torch.bmm(q1n.transpose(0, 1), w_uk).view(H, C)
            sc = torch.softmax((q_abs @ lat.t() + q1p[0] @ rk.t()) * scale, -1)
            return torch.bmm((sc @ lat).view(H, 1, C), w_uv_t)

        tdb = best_ms(dec_before, a.reps * 3)
        tdo = best_ms(lambda: K.mla_attention(pool, q1n, q1p, lat, rk, w_uk, w_uv_t, T - 1, scale, out=o1),
                      a.reps * 3)
        print(f"{'':12} {T:6d} {tq:9.1f} {tb:9.1f} {to:8.1f} {tq / to:10.2f} {tb / to:11.2f} | {tdb:10.3f} "
              f"{tdo:8.3f} {tdb / tdo:6.2f}", flush=True)
    return 0


def decode_rows(a, pool) -> int:
    """One decode row over N cached keys: attend_rows (the prompt kernel's arithmetic, fp32 and bf16
    P V) next to torch's sdpa for one query."""
    from ktransformers import cpuinfer_ext

    ops, c = cpuinfer_ext.decode_ops, pool._c
    print(f"{'shape':8} {'depth':>6} {'torch ms':>9} {'ours ms':>8} {'bf16pv ms':>9} {'KV GB/s':>8} "
          f"{'ours/torch':>10} {'bf16pv/torch':>12}")
    for name in a.shapes.split(","):
        H, Hkv, D = SHAPES[name]
        for N in (int(t) for t in a.decode.split(",")):
            cap = N + 1
            keys, values = torch.randn(Hkv, cap, D), torch.randn(Hkv, cap, D)
            qkv = torch.randn(1, (H + 2 * Hkv) * D)
            cos, sin = torch.ones(1, D), torch.zeros(1, D)
            pos, lo = torch.tensor([N]), torch.tensor([0])
            out = torch.empty(1, H * D)
            scale = D ** -0.5

            def ours(bf16):
                ops.attend_rows(c, qkv.data_ptr(), 1, H, Hkv, D, 0, 0.0, cos.data_ptr(), sin.data_ptr(),
                                keys.data_ptr(), values.data_ptr(), D, cap * D, 0, 0, 0, pos.data_ptr(),
                                lo.data_ptr(), 0, cap, 0, scale, out.data_ptr(), bf16_pv=bf16)

            q = qkv[:, : H * D].reshape(1, H, 1, D)
            k, v = keys[None], values[None]
            tq = best_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), a.reps)
            t32 = best_ms(lambda: ours(False), a.reps)
            tbf = best_ms(lambda: ours(True), a.reps)
            gbs = 2 * Hkv * cap * D * 4 / t32 / 1e6
            print(f"{name:8} {N:6d} {tq:9.3f} {t32:8.3f} {tbf:9.3f} {gbs:8.1f} {tq / t32:10.2f} {tq / tbf:12.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
