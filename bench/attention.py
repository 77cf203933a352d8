"""Causal prompt attention: the project's flash kernel (fp32, and with bf16 P x V) next to torch's
own CPU flash kernel (``scaled_dot_product_attention(..., is_causal=True)``, fp32), one process,
same thread count, as ratios (torch ms / ours ms: > 1 means ours is faster).

Shapes: Qwen3-30B-A3B (32 query / 4 KV heads of 128) and Gemma-3-270M (4 / 1 of 256), one layer.

    .venv/bin/python bench/attention.py                       # 512, 2048, 8192 tokens, 2 threads
    .venv/bin/python bench/attention.py --tokens 4096,16384 --shapes qwen3
    .venv/bin/python bench/attention.py --decode 512,4096,32768   # one decode row at these depths

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
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    pool = K.cpu_infer(a.threads)
    print(machine_line(None) + f", {a.threads} threads")
    if not K.flash_attention_supported():
        print("the ISA tier in force has no AVX2 + FMA: the flash kernel does not run here (torch's sdpa serves)")
        return 0
    if a.decode:
        return decode_rows(a, pool)
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
