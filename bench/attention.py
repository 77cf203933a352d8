"""Causal prompt attention: the project's flash kernel (fp32, and with bf16 P x V) next to torch's
own CPU flash kernel (``scaled_dot_product_attention(..., is_causal=True)``, fp32), one process,
same thread count, as ratios (torch ms / ours ms: > 1 means ours is faster).

Shapes: Qwen3-30B-A3B (32 query / 4 KV heads of 128) and Gemma-3-270M (4 / 1 of 256), one layer.

    .venv/bin/python bench/attention.py                       # 512, 2048, 8192 tokens, 2 threads
    .venv/bin/python bench/attention.py --tokens 4096,16384 --shapes qwen3
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
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    pool = K.cpu_infer(a.threads)
    print(machine_line(None) + f", {a.threads} threads")
    if not K.flash_attention_supported():
        print("the ISA tier in force has no AVX512-BF16: the flash kernel does not run here (torch's sdpa serves)")
        return 0
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


if __name__ == "__main__":
    raise SystemExit(main())
