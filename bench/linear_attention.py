"""Gated-DeltaNet linear attention, one layer: the project's token-by-token kernels
(``kernels.attention.causal_conv_silu`` + ``gated_delta_rule``) next to transformers' own CPU code
(``causal_conv1d_fn`` + ``torch_chunk_gated_delta_rule`` for a prompt, ``causal_conv1d_update``'s
math + ``torch_recurrent_gated_delta_rule`` for one decode token: what transformers runs without the
CUDA-only causal-conv1d / flash-linear-attention packages), one process, same thread count, as
ratios (transformers ms / ours ms: > 1 means ours is faster).  Not a test.

Shape: Qwen3-Next-80B-A3B's DeltaNet (16 key heads / 32 value heads of 128, conv of 4 taps; the
projections around it are linears, benchmarked in bench/linear.py).

    .venv/bin/python bench/linear_attention.py                       # 1, 512, 4096 tokens, 2 threads
    .venv/bin/python bench/linear_attention.py --tokens 1,16384 --threads 1
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def machine_line() -> str:
    from ktransformers.kernels import isa_tier

    info = Path("/proc/cpuinfo").read_text()
    name = (re.search(r"^model name\s*:\s*(.*)$", info, re.M) or [None, "?"])[1]
    return f"machine: {name}, {os.cpu_count()} CPUs, ISA tier {isa_tier()}, torch {torch.__version__}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,512,4096")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    from transformers.models.qwen3_next import modeling_qwen3_next as M
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its "install the CUDA packages" notes

    from ktransformers.kernels.attention import causal_conv_silu, gated_delta_rule
    from ktransformers.kernels.pool import cpu_infer

    torch.set_num_threads(args.threads)
    pool = cpu_infer(args.threads)
    hk, hv, dk, dv, K = 16, 32, 128, 128, 4
    C = 2 * hk * dk + hv * dv
    print(machine_line())
    print(f"Qwen3-Next DeltaNet: {hk} key / {hv} value heads of {dk}, conv {K} taps; {args.threads} threads")
    print(f"{'tokens':>7}  {'ours ms':>9}  {'transformers ms':>15}  {'ratio':>6}  max |diff| / max |out|")
    for T in (int(t) for t in args.tokens.split(",")):
        g = torch.Generator().manual_seed(0)
        qkv = torch.randn(T, C, generator=g)
        b, a = torch.randn(T, hv, generator=g), torch.randn(T, hv, generator=g)
        A_log, dt_bias = torch.log(torch.rand(hv, generator=g) * 15 + 0.5), torch.randn(hv, generator=g)
        w = torch.randn(C, K, generator=g) * 0.5
        window = F.pad(qkv.T, (K - 1, 0)).contiguous()  # a fresh sequence: zeros before it

        def ours():
            y = causal_conv_silu(pool, window, w, T)
            return gated_delta_rule(pool, y, b, a, A_log, dt_bias, torch.zeros(hv, dk, dv), hk, dk)

        def theirs():
            if T == 1:  # causal_conv1d_update's math on the window
                y = F.silu(F.conv1d(window[None], w[:, None], groups=C))[0].T
            else:
                y = M.causal_conv1d_fn(qkv.T[None], w, None, activation="silu")[0].T
            q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], -1)
            fn = M.torch_recurrent_gated_delta_rule if T == 1 else M.torch_chunk_gated_delta_rule
            out, _ = fn(q.reshape(1, T, hk, dk), k.reshape(1, T, hk, dk), v.reshape(1, T, hv, dv),
                        g=(-A_log.exp() * F.softplus(a + dt_bias))[None], beta=b.sigmoid()[None],
                        initial_state=torch.zeros(1, hv, dk, dv), output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
            return out[0]

        times = {}
        outs = {}
        for name, f in (("ours", ours), ("theirs", theirs)):
            outs[name] = f()
            reps = args.reps * (20 if T == 1 else 1)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                f()
                best = min(best, time.perf_counter() - t0)
            times[name] = best * 1e3
        err = ((outs["ours"] - outs["theirs"]).abs().max() / outs["theirs"].abs().max()).item()
        ratio = times["theirs"] / times["ours"]
        print(f"{T:>7}  {times['ours']:>9.3f}  {times['theirs']:>15.3f}  {ratio:>6.2f}  {err:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
