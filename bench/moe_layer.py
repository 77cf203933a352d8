"""Benchmark one routed-experts MoE layer on the CPU (not a test).

Prints, side by side for Qwen3-30B-A3B (H2048 I768 E128 k8) and DeepSeek-V2-Lite
(H2048 I1408 E64 k6), decode T=1 and prefill T=128/512, 1 and 2 threads:
  * this project: llamafile Q4_K, Q8_0, BF16; AMXInt8; AMXInt4; AMXInt4_1; AMXBF16 (ktransformers.kernels)
  * a naive torch per-expert loop (bf16), the usual baseline
  * kt-kernel (PyPI) when importable: its AMXInt8_MOE / AMXBF16_MOE / AMXInt4_MOE / AMXInt4_1_MOE
    (rows kt:AMXInt8 ..., quantised online from the same bf16 weights), and at the end each of our
    packed rows as a speed ratio over kt-kernel's row of the same backend; llama.cpp: a note
Per row: median ms (>= 20 timed calls, random routing with a fixed seed, a different routing
per call), effective weight GB/s (bytes of the experts hit / time; int4 counts its fp16 scales
(and mins) too: 0.5625 / 0.625 bytes per weight), GFLOP/s (2*3*H*I*T*k / time),
the DRAM read bandwidth measured with the same threads just before and after the row (the
mean of the two; a shared host's bandwidth drifts by up to 2x within minutes, so one probe at
start-up mis-states the fraction) and the row's fraction of it, the fraction of the compute peak
measured at start-up (the extension's probes), and the speed-up over the torch loop.

    .venv/bin/python bench/moe_layer.py                  # everything (~10-20 min on 2 cores)
    .venv/bin/python bench/moe_layer.py --shapes qwen3 --tokens 1 --threads 1 --reps 30
    .venv/bin/python bench/moe_layer.py --quick          # Qwen3 only, T=1,128, 1 thread, no torch row
    .venv/bin/python bench/moe_layer.py --quick --variants Q4_K --tokens 1   # --quick + overrides
    .venv/bin/python bench/moe_layer.py --variants Q4_K,Q4_K@llamafile_panels --tokens 1,32,512  # TYPE@backend
Weights are random (valid blocks), allocated once per shape and variant and freed afterwards
(Qwen3 BF16 layer ~1.2 GB).  DeepSeek-V2-Lite's I=1408 is not a multiple of 256, so its "Q4_K"
row uses Q4_K for gate/up and Q8_0 for down (what llama.cpp's quantizer falls back to).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ktransformers.cpuinfer_ext as ext  # noqa: E402
import ktransformers.kernels as K  # noqa: E402

SHAPES = {"qwen3": ("Qwen3-30B-A3B", 2048, 768, 128, 8), "dsv2": ("DeepSeek-V2-Lite", 2048, 1408, 64, 6)}
BLOCK = {"Q4_K": (256, 144), "Q8_0": (32, 34), "BF16": (1, 2), "Q4_0": (32, 18), "Q5_K": (256, 176),
         "Q6_K": (256, 210), "Q2_K": (256, 84), "Q3_K": (256, 110), "IQ4_XS": (256, 136), "IQ4_NL": (32, 18),
         "Q5_0": (32, 22)}
F16_AT = {"Q4_K": (0, 2), "Q8_0": (0,), "Q4_0": (0,), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82),
          "Q3_K": (108,), "IQ4_XS": (0,), "IQ4_NL": (0,), "Q5_0": (0,)}  # byte offsets of d (, dmin)
PACKED = ("AMXInt8", "AMXBF16", "AMXInt4", "AMXInt4_1")  # backends repacked from BF16 at load
#: bytes read per weight by the packed backends (int4: nibbles + fp16 scale (+ min) per 32)
PACKED_BPE = {"AMXInt8": 1.0, "AMXBF16": 2.0, "AMXInt4": 0.5 + 2 / 32, "AMXInt4_1": 0.5 + 4 / 32}


def rand_weights(t: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid ggml bytes, rows x cols elements of type t (uint8, flat)."""
    be, bb = BLOCK[t]
    if t == "BF16":  # random sign/mantissa, exponent for |w| in [2^-7, 2^-6)
        bits = rng.integers(0, 1 << 16, size=rows * cols, dtype=np.uint16)
        return ((bits & 0x807F) | 0x3C00).astype(np.uint16).view(np.uint8)
    nb = rows * cols // be
    raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
    d = np.full(nb, 2e-4, np.float16).view(np.uint8).reshape(nb, 2)
    for off in F16_AT[t]:
        raw[:, off:off + 2] = d
    return raw.reshape(-1)


def routings(T: int, E: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64)
        w = rng.random((T, k)).astype(np.float32)
        out.append((ids, w / w.sum(1, keepdims=True)))
    return out


# --cpu-time: time.process_time (this process's CPU time: comparable between runs on a shared,
# loaded machine; the GB/s columns are then per CPU second, not wall-clock rates)
CLOCK = time.perf_counter


def read_bw(pool) -> float:
    """DRAM read GB/s with the pool's threads (best of 3 sums over 256 MiB)."""
    return pool.probe_read_bw(1 << 28, 3)


def time_calls(fn, routes, warmup: int = 3) -> float:
    for i in range(warmup):
        fn(*routes[i % len(routes)])
    ts = []
    for ids, w in routes:
        t0 = CLOCK()
        fn(ids, w)
        ts.append(CLOCK() - t0)
    return statistics.median(ts)


def torch_loop(x, ids, w, g, u, d):
    """Naive per-expert SwiGLU loop over the experts hit (bf16)."""
    out = torch.zeros_like(x)
    ids_t, w_t = torch.from_numpy(ids), torch.from_numpy(w).to(x.dtype)
    for e in torch.unique(ids_t).tolist():
        tok, slot = torch.nonzero(ids_t == e, as_tuple=True)
        xe = x[tok]
        h = torch.nn.functional.silu(xe @ g[e].T) * (xe @ u[e].T)
        out.index_add_(0, tok, (h @ d[e].T) * w_t[tok, slot, None])
    return out


def fmt_peak(v: float, unit: str) -> str:
    """A probe returns 0 where this tier has no such unit (e.g. bf16 dot on AVX2)."""
    return f"{v:.0f} {unit}" if v > 0 else "n/a"


def kernel_label(var: str, types: tuple[str, str, str], T: int) -> str:
    """Which kernel served the row: the llamafile table of the tier (decode or prefill column)."""
    if var == "torch":
        return "torch"
    if var.startswith("kt:"):
        return f"kt_kernel {var[3:]}_MOE"
    if var in PACKED or "@" in var:
        dec, pre, _ = ext.packed_rows()[var.partition("@")[2] or var]
        return dec if T == 1 else pre
    rows = ext.kernel_rows()
    names = dict.fromkeys(rows[t][0 if T == 1 else 1] for t in (types[0], types[2]))
    return "/".join(names)


class KtKernelMoE:
    """kt-kernel's MoE class ``name`` (e.g. AMXInt4_MOE) on bf16 weights, with the direct API of
    shared/notes/peer-bench.md section 3; ``forward(x_f32, ids, w)`` like MoEKernel's."""

    def __init__(self, name: str, threads: int, E: int, H: int, I: int, k: int, max_len: int, g, u, d):
        from kt_kernel import kt_kernel_ext as kx

        self.cpu = kx.CPUInfer(threads)
        self.k, self.H = k, H
        self._w = [torch.frombuffer(a, dtype=torch.bfloat16).view(E, *sh)
                   for a, sh in ((g, (I, H)), (u, (I, H)), (d, (H, I)))]
        cfg = kx.moe.MOEConfig(E, k, H, I, 0)
        cfg.max_len = max_len
        cfg.pool = self.cpu.backend_
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (t.data_ptr() for t in self._w)
        self.cfg = cfg
        self.moe = getattr(kx.moe, name)(cfg)
        self._ids = torch.arange(E, dtype=torch.int64)
        self.cpu.submit(self.moe.load_weights_task(self._ids.data_ptr()))
        self.cpu.sync()
        self.packed_bytes = 0  # not reported by kt-kernel

    def forward(self, x, ids, w, out):
        T = x.shape[0]
        xb = x.to(torch.bfloat16).contiguous()
        ob = torch.empty(T, self.H, dtype=torch.bfloat16)
        ids_t = torch.as_tensor(ids, dtype=torch.int64).contiguous()
        w_t = torch.as_tensor(w, dtype=torch.float32).contiguous()
        bsz = torch.tensor([T], dtype=torch.int32)
        self.cpu.submit(self.moe.forward_task(bsz.data_ptr(), self.k, ids_t.data_ptr(), w_t.data_ptr(),
                                              xb.data_ptr(), ob.data_ptr(), False))
        self.cpu.sync()
        out.copy_(ob)
        return out


def call_overhead_us(n: int = 2000) -> float:
    """Median wall time of MoEKernel.forward on a tiny Q8_0 layer (E=8, H=I=64, k=2): ~all overhead."""
    E, H, I, k = 8, 64, 64, 2
    rng = np.random.default_rng(0)
    w = [rand_weights("Q8_0", E * r, c, rng) for r, c in ((I, H), (I, H), (H, I))]
    moe = K.MoEKernel(K.cpu_infer(1), "llamafile", E, H, I, *w, "Q8_0", "Q8_0", "Q8_0")
    x, out = torch.randn(1, H), torch.empty(1, H)
    ids, wt = torch.tensor([[1, 5]]), torch.tensor([[0.5, 0.5]])
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        moe.forward(x, ids, wt, out)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[n // 10:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,dsv2")
    ap.add_argument("--tokens", default="1,128,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--variants", default="torch,Q4_K,Q8_0,BF16,AMXInt8,AMXInt4,AMXInt4_1,AMXBF16",
                    help="torch first: the other rows report their speed-up over it; also Q4_0, Q5_0, Q5_K, Q6_K; "
                         "kt:AMXInt8, kt:AMXBF16, kt:AMXInt4 and kt:AMXInt4_1 are appended when kt_kernel is importable")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per row (median)")
    ap.add_argument("--quick", action="store_true",
                    help="defaults become: qwen3, T=1,128, 1 thread, Q4_K,Q8_0,BF16,AMXInt8,AMXInt4,AMXInt4_1,AMXBF16, "
                         "smaller probes, plus the per-call Python overhead; explicit options still win")
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time (loaded machine)")
    args = ap.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if args.quick:
        given = {a.split("=")[0] for a in sys.argv[1:]}
        for opt, val in (("--shapes", "qwen3"), ("--tokens", "1,128"), ("--threads", "1"),
                         ("--variants", "Q4_K,Q8_0,BF16,AMXInt8,AMXInt4,AMXInt4_1,AMXBF16")):
            if opt not in given:
                setattr(args, opt[2:], val)
    tokens = [int(v) for v in args.tokens.split(",")]
    threads_l = [int(v) for v in args.threads.split(",")]
    variants = args.variants.split(",")

    print(f"ISA tier: {K.isa_tier()}; torch {torch.__version__}")
    probes = {}
    for th in threads_l:
        p = K.cpu_infer(th)
        nb, it = ((1 << 28, 3_000_000) if args.quick else (1 << 30, 3_000_000))
        bw = max(p.probe_read_bw(nb, 3) for _ in range(2))
        peaks = {k: p.probe_peak(k, it) for k in ("fp32", "bf16", "int8")}
        probes[th] = (bw, peaks)
        print(f"probe {th} thread(s): DRAM read {bw:.1f} GB/s, fp32 {fmt_peak(peaks['fp32'], 'GFLOP/s')}, "
              f"bf16 {fmt_peak(peaks['bf16'], 'GFLOP/s')}, int8 {fmt_peak(peaks['int8'], 'GOP/s')}")
    try:
        __import__("kt_kernel")
        if "--variants" not in {a.split("=")[0] for a in sys.argv[1:]}:
            variants += [f"kt:{b}" for b in PACKED if b in variants]
    except ImportError:
        print("note: kt_kernel not importable here: its rows skipped (numbers in shared/notes/peer-bench.md)")
        variants = [v for v in variants if not v.startswith("kt:")]
    try:
        __import__("llama_cpp")
        print("note: llama_cpp is importable but not wired into this bench yet; see shared/notes/peer-bench.md")
    except ImportError:
        print("note: llama_cpp not importable here: skipped (numbers in shared/notes/peer-bench.md)")

    if args.quick:
        print(f"python call overhead (tiny layer, T=1, 1 thread): {call_overhead_us():.1f} us per forward")
    rows = []
    timed: dict = {}  # (shape, variant, threads, T) -> ms
    hdr = (f"{'shape':17s} {'variant':14s} {'thr':>3s} {'T':>4s} {'ms':>9s} {'GB/s':>6s} {'GFLOP/s':>8s} "
           f"{'DRAM':>5s} {'%DRAM':>6s} {'%peak':>6s} {'vs torch':>8s}  kernel")
    print(hdr)
    for sk in args.shapes.split(","):
        sname, H, I, E, k = SHAPES[sk]
        torch_ms: dict = {}
        for var in variants:
            rng = np.random.default_rng(1)
            vtype, _, vbackend = var.partition("@")  # "Q4_K@llamafile_panels": a GGUF type on another backend
            if var in ("BF16", "torch") or var in PACKED or var.startswith("kt:"):
                gt = ut = dt = "BF16"
            elif vtype == "Q4_K" and I % 256:
                gt, ut, dt = "Q4_K", "Q4_K", "Q8_0"
            else:
                gt = ut = dt = vtype
            t0 = time.perf_counter()
            g = rand_weights(gt, E * I, H, rng)
            u = rand_weights(ut, E * I, H, rng)
            d = rand_weights(dt, E * H, I, rng)
            label = var if (gt, dt) == (vtype, vtype) or var in PACKED or var in ("torch",) or var.startswith("kt:") \
                else f"{gt}/down {dt}"
            for th in threads_l:
                pool = K.cpu_infer(th)
                if var == "torch":
                    torch.set_num_threads(th)
                    tg, tu, td = (torch.frombuffer(a, dtype=torch.bfloat16).view(E, *s)
                                  for a, s in ((g, (I, H)), (u, (I, H)), (d, (H, I))))
                    moe = None
                elif var.startswith("kt:"):
                    tl = time.perf_counter()
                    try:
                        moe = KtKernelMoE(f"{var[3:]}_MOE", th, E, H, I, k, max(tokens), g, u, d)
                    except Exception as e:  # noqa: BLE001 - a peer's failure is a row, not the end of the report
                        print(f"{sname:17s} {label:14s} {th:3d}  failed: {type(e).__name__}: {e}", flush=True)
                        continue
                    load_s = time.perf_counter() - tl
                else:
                    backend = var if var in PACKED else (vbackend or "llamafile")
                    tl = time.perf_counter()
                    moe = K.MoEKernel(pool, backend, E, H, I, g, u, d, gt, ut, dt)
                    load_s = time.perf_counter() - tl
                for T in tokens:
                    routes = routings(T, E, k, max(args.reps, 20))
                    x32 = torch.randn(T, H, generator=torch.Generator().manual_seed(T)) * 0.5
                    if var == "torch":
                        x = x32.to(torch.bfloat16)
                        fn = lambda ids, w: torch_loop(x, ids, w, tg, tu, td)  # noqa: E731
                        peak_kind = "bf16"
                    else:
                        out = torch.empty(T, H)
                        fn = lambda ids, w: moe.forward(x32, ids, w, out)  # noqa: E731
                        peak_kind = "bf16" if var in ("BF16", "AMXBF16") else "int8"
                    bw_before = read_bw(pool)
                    ms = time_calls(fn, routes) * 1e3
                    bw_row = (bw_before + read_bw(pool)) / 2  # the host's bandwidth drifts: probe next to the row
                    hit = np.mean([len(np.unique(ids)) for ids, _ in routes])
                    if var in PACKED or var.startswith("kt:"):
                        bpe = (PACKED_BPE[var.removeprefix("kt:")],) * 3
                    elif var in ("BF16", "torch"):
                        bpe = (2.0, 2.0, 2.0)
                    else:  # (llamafile_panels: 148 bytes a Q4_K superblock row where the file has 144)
                        bpe = tuple(BLOCK[t][1] / BLOCK[t][0] for t in (gt, ut, dt))
                    wbytes = hit * I * H * sum(bpe)
                    gbs = wbytes / ms / 1e6
                    gflops = 2 * 3 * H * I * T * k / ms / 1e6
                    _, peaks = probes[th]
                    if var == "torch":
                        torch_ms[(th, T)] = ms
                    vs = f"{torch_ms[(th, T)] / ms:7.2f}x" if (th, T) in torch_ms else f"{'-':>8s}"  # no torch row run
                    peak = peaks[peak_kind]
                    pk = f"{100 * gflops / peak:5.1f}%" if peak > 0 else f"{'n/a':>6s}"
                    line = (f"{sname:17s} {label:14s} {th:3d} {T:4d} {ms:9.3f} {gbs:6.1f} {gflops:8.1f} "
                            f"{bw_row:5.1f} {100 * gbs / bw_row:5.0f}% {pk} {vs}  {kernel_label(var, (gt, ut, dt), T)}")
                    print(line, flush=True)
                    rows.append(line)
                    timed[(sname, var, th, T)] = ms
                if moe is not None and (var in PACKED or vbackend):
                    print(f"  ({var} load+repack {load_s:.1f} s, {moe.packed_bytes / 1e9:.2f} GB)")
                del moe
            del g, u, d
            gc.collect()
    print("\n" + hdr + "\n" + "\n".join(rows))
    pairs = [(key, ms, timed[(key[0], "kt:" + key[1], *key[2:])]) for key, ms in timed.items()
             if (key[0], "kt:" + key[1], *key[2:]) in timed]
    if pairs:
        print("\nours / kt-kernel, same backend (speed ratio: kt ms / our ms; > 1 = we are faster)")
        for (sname, var, th, T), ms, kt_ms in pairs:
            print(f"{sname:17s} {var:10s} thr {th} T {T:4d}: ours {ms:9.3f} ms, kt {kt_ms:9.3f} ms, {kt_ms / ms:5.2f}x")


if __name__ == "__main__":
    main()
