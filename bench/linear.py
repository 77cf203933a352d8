"""Benchmark the dense CPU linear (``ktransformers.kernels.LinearKernel``, llamafile backend) per
weight type, side by side with torch ``F.linear`` on the dequantised fp32 weight (not a test).

Per (shape, type, T): median ms of the kernel, median ms of torch fp32 F.linear on the same
weight dequantised once (``K.dequantize``), the ratio torch/kernel (> 1: the kernel is faster),
effective weight GB/s (bytes of the ggml weight / time) and the fraction of the DRAM read
bandwidth that ``CPUInfer.probe_read_bw`` measures at start-up with the same thread count.

    .venv/bin/python bench/linear.py                                  # full grid, 1 and 2 threads
    .venv/bin/python bench/linear.py --types Q8_0 --shapes lm_head --tokens 1 --threads 1,2
    .venv/bin/python bench/linear.py --quick                          # fewer reps, no lm_head prefill

Shapes (out x in, as the weight is stored): 640x2048 (Gemma-3-270M down), 2048x640 (gate/up),
262144x640 (Gemma-3 lm_head / token_embd, Q8_0 in the Q4_K_M file) and 2048x768 (Qwen3 expert
down), 2048x2048 (a square matrix for the per-type GB/s).  Types: every llamafile type (random
valid blocks; the K-quants, IQ4_XS and the IQ1/IQ2/IQ3 grid types need in % 256 == 0, so they skip
640-column shapes).  The last column names the kernel that served the row, from
the tier's kernel table (``cpuinfer_ext.kernel_rows()``: decode kernel at T=1, else prefill).

With ``--llama_cpp_bin DIR`` (a llama.cpp build with ``-DLLAMA_BUILD_TESTS=ON``; see bench/README.md)
a second table puts each type next to llama.cpp's own CPU matrix multiply on the same shape in the
same run: its ``test-backend-ops perf`` case 4096x14336 (out x in) at the requested token counts
(it has 1, 2, 3, 4, 5, 8 and 512), with the thread count that tool uses (half the hardware threads),
ours timed on the same shape with the same thread count; ratio = llama.cpp ms / ours (> 1: ours
is faster).  Both include their activation quantisation.

    .venv/bin/python bench/linear.py --llama_cpp_bin DIR --tokens 1 --types IQ1_S,IQ2_XXS,Q4_K --shapes 2048x2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ktransformers.cpuinfer_ext as ext  # noqa: E402
import ktransformers.kernels as K  # noqa: E402

SHAPES = {"640x2048": (640, 2048), "2048x640": (2048, 640), "lm_head": (262144, 640), "2048x768": (2048, 768),
          "2048x2048": (2048, 2048)}
# (block elems, block bytes, byte offsets of fp16 scales)
BLOCK = {"Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
         "Q8_0": (32, 34, (0,)), "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
         "Q5_1": (32, 24, (0, 2)), "IQ4_NL": (32, 18, (0,)), "IQ4_XS": (256, 136, (0,)),
         "Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)), "F32": (1, 4, ()), "F16": (1, 2, ()),
         "BF16": (1, 2, ()),
         # low-bit grid types of the 1.58/2.51-bit dynamic files (IQ1_M: see rand_weights)
         "IQ1_S": (256, 50, (0,)), "IQ1_M": (256, 56, ()), "IQ2_XXS": (256, 66, (0,)), "IQ2_XS": (256, 74, (0,)),
         "IQ2_S": (256, 82, (0,)), "IQ3_XXS": (256, 98, (0,)), "IQ3_S": (256, 110, (0,))}
FLOAT = {"F32": np.float32, "F16": np.float16}


def rand_weights(t: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    be, bb, offs = BLOCK[t]
    if t in FLOAT:
        return (rng.standard_normal(rows * cols) * 0.02).astype(FLOAT[t]).view(np.uint8)
    if t == "BF16":
        bits = rng.integers(0, 1 << 16, size=rows * cols, dtype=np.uint16)
        return ((bits & 0x807F) | 0x3C00).astype(np.uint16).view(np.uint8)
    nb = rows * cols // be
    raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
    d = np.full(nb, 2e-4, np.float16).view(np.uint8).reshape(nb, 2)
    for off in offs:
        raw[:, off:off + 2] = d
    if t == "IQ1_M":  # its fp16 scale is the top nibbles of the four uint16 scale words
        sc = raw[:, 48:56].copy().view(np.uint16) & 0x0FFF
        bits = d.copy().view(np.uint16)[:, 0]
        for j in range(4):
            sc[:, j] |= ((bits >> (4 * j)) & 0xF) << 12
        raw[:, 48:56] = sc.view(np.uint8)
    return raw.reshape(-1)


# --cpu-time: time.process_time (this process's CPU time: comparable between runs on a shared,
# loaded machine; the GB/s columns are then per CPU second, not wall-clock rates)
CLOCK = time.perf_counter


def median_ms(fn, n: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"names ({', '.join(SHAPES)}) or OUTxIN")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q2_K,Q3_K,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,IQ4_NL,IQ4_XS,F32,F16,BF16,"
                                       "IQ1_S,IQ1_M,IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S")
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch column")
    ap.add_argument("--quick", action="store_true", help="reps 7, lm_head decode only")
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time (loaded machine)")
    ap.add_argument("--llama_cpp_bin", help="llama.cpp build/bin with test-backend-ops: per-type rows next to it")
    args = ap.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    reps = 7 if args.quick else args.reps
    tokens = [int(v) for v in args.tokens.split(",")]
    threads_l = [int(v) for v in args.threads.split(",")]
    print(f"ISA tier: {K.isa_tier()}; torch {torch.__version__}")
    bw = {}
    for th in threads_l:
        bw[th] = max(K.cpu_infer(th).probe_read_bw(1 << 29, 3) for _ in range(2))
        print(f"probe {th} thread(s): DRAM read {bw[th]:.1f} GB/s")
    table = ext.kernel_rows()
    print(f"kernel table of tier {K.isa_tier()} (type: decode kernel / prefill kernel / activation format):")
    for t in args.types.split(","):
        print(f"  {t:8s} {' / '.join(table[t])}")
    print(f"{'shape':10s} {'type':7s} {'thr':>3s} {'T':>4s} {'kernel ms':>10s} {'torch ms':>9s} {'ratio':>6s} "
          f"{'GB/s':>6s} {'%DRAM':>6s}  kernel")
    for sk in args.shapes.split(","):
        N, Kin = SHAPES[sk] if sk in SHAPES else map(int, sk.split("x"))  # or any "OUTxIN"
        for t in args.types.split(","):
            be = BLOCK[t][0]
            if Kin % be:
                continue
            rng = np.random.default_rng(0)
            raw = rand_weights(t, N, Kin, rng)
            wf = None
            if not args.no_torch:
                wf = torch.from_numpy(K.dequantize(raw, t).reshape(N, Kin))
            for th in threads_l:
                pool = K.cpu_infer(th)
                torch.set_num_threads(th)
                lin = K.LinearKernel(pool, "llamafile", Kin, N, raw, t)
                for T in tokens:
                    if sk == "lm_head" and T > 16 and args.quick:
                        continue
                    x = torch.randn(T, Kin, generator=torch.Generator().manual_seed(T))
                    out = torch.empty(T, N)
                    n = reps if (sk != "lm_head" or T <= 16) else 3
                    ms = median_ms(lambda: lin.forward(x, out), n)
                    tms = float("nan")
                    if wf is not None:
                        tout = torch.empty(T, N)
                        tms = median_ms(lambda: torch.matmul(x, wf.t(), out=tout), n)
                        ref = F.linear(x, wf)
                        err = (out - ref).norm() / ref.norm()
                        if err > 3e-2:
                            print(f"  !! {sk} {t} T={T}: rel err {err:.3g} vs torch")
                    gbs = raw.nbytes / ms / 1e6
                    vs = f"{tms:9.3f} {tms / ms:6.2f}" if wf is not None else f"{'-':>9s} {'-':>6s}"  # --no-torch
                    print(f"{sk:10s} {t:7s} {th:3d} {T:4d} {ms:10.3f} {vs} {gbs:6.1f} "
                          f"{100 * gbs / bw[th]:5.0f}%  {table[t][0 if T == 1 else 1]}", flush=True)
                del lin
    if args.llama_cpp_bin:
        versus_llama_cpp(Path(args.llama_cpp_bin), args.types.split(","), tokens, reps)


#: the matrix of llama.cpp's test-backend-ops perf cases (out x in) and the token counts it has
LLAMA_SHAPE, LLAMA_TOKENS = (4096, 14336), (1, 2, 3, 4, 5, 8, 512)


def llama_cpp_ms(tool: Path, t: str, T: int) -> float | None:
    """llama.cpp's CPU MUL_MAT of type ``t`` on LLAMA_SHAPE with T tokens (f32 activations), ms per run."""
    import re
    import subprocess

    N, Kin = LLAMA_SHAPE
    ggml_name = t.lower().replace("_k", "_K")  # q4_K, iq2_xxs, bf16: ggml's type names
    pat = f"type_a={ggml_name},type_b=f32,m={N},n={T},k={Kin},"
    r = subprocess.run([str(tool), "perf", "-o", "MUL_MAT", "-b", "CPU", "-p", re.escape(pat)],
                       capture_output=True, text=True, timeout=600)
    m = re.search(r"([0-9.]+) us/run", r.stdout)
    return float(m.group(1)) / 1e3 if m else None


def versus_llama_cpp(bindir: Path, types: list[str], tokens: list[int], reps: int) -> None:
    """Each type on llama.cpp's test-backend-ops shape, ours and theirs, same thread count."""
    import os

    tool = bindir / "test-backend-ops"
    if not tool.is_file():
        print(f"note: {tool} not found (build llama.cpp with -DLLAMA_BUILD_TESTS=ON); no llama.cpp rows")
        return
    th = max(1, (os.cpu_count() or 2) // 2)  # what test-backend-ops gives its CPU backend
    N, Kin = LLAMA_SHAPE
    pool = K.cpu_infer(th)
    print(f"\nvs llama.cpp's test-backend-ops MUL_MAT, {N}x{Kin}, {th} thread(s) each "
          "(ratio = llama.cpp ms / ours: > 1, ours is faster)")
    print(f"{'type':7s} {'T':>4s} {'ours ms':>9s} {'llama.cpp ms':>13s} {'ratio':>6s}  kernel")
    table = ext.kernel_rows()
    for t in types:
        if Kin % BLOCK[t][0]:
            continue
        lin = K.LinearKernel(pool, "llamafile", Kin, N, rand_weights(t, N, Kin, np.random.default_rng(0)), t)
        for T in (T for T in tokens if T in LLAMA_TOKENS):
            x = torch.randn(T, Kin, generator=torch.Generator().manual_seed(T))
            out = torch.empty(T, N)
            ms = median_ms(lambda: lin.forward(x, out), reps if T <= 8 else 3)
            theirs = llama_cpp_ms(tool, t, T)
            cell = f"{theirs:13.3f} {theirs / ms:6.2f}" if theirs else f"{'n/a':>13s} {'-':>6s}"
            print(f"{t:7s} {T:4d} {ms:9.3f} {cell}  {table[t][0 if T == 1 else 1]}", flush=True)
        del lin


if __name__ == "__main__":
    main()
