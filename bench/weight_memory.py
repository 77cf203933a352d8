"""Does the kind of memory the weights sit in change the decode rate?  (not a test)

One DeepSeek-V2-Lite-shaped routed-experts layer (H2048 I1408 E64 top-6; gate/up Q4_K, down
``--down``) is laid out ``--layers`` times in each of three kinds of memory, and decode calls (T=1,
random routing, a different routing per call, every layer in turn as a model does) are timed on
each:

* ``anon 4K``: anonymous memory advised ``MADV_NOHUGEPAGE`` (4 KiB pages; numpy advises huge pages
  for its own large arrays, so a plain copy would not do);
* ``anon THP``: anonymous memory advised ``MADV_HUGEPAGE`` (2 MiB pages when the kernel grants them;
  ``AnonHugePages`` in /proc/self/smaps_rollup is printed);
* ``file mmap``: a read-only mapping of a file holding the same bytes, read through the page cache
  first (what ``load_model`` does with a GGUF: 4 KiB page-cache pages).

Prints per kind the effective weight GB/s (bytes of the experts hit / time; median of ``--reps``
passes), its ratio to ``anon 4K`` and the DRAM read probe with the same threads, with the ISA tier.
With more layers than the last-level cache holds each call reads its experts from DRAM.

    .venv/bin/python bench/weight_memory.py                       # 8 layers (3.2 GB per kind), 2 threads
    .venv/bin/python bench/weight_memory.py --down Q5_0 --layers 4
    .venv/bin/python bench/weight_memory.py --gap_us 2500     # 2.5 ms of other work between calls
The file goes to ``--dir`` (default .cache) and is removed at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import ktransformers.kernels as K  # noqa: E402
import moe_layer as ML  # noqa: E402

H, I, E, TOP_K = 2048, 1408, 64, 6
DOWN = ("Q8_0", "Q5_0", "Q4_0")  # I = 1408 is no multiple of 256: a 32-element format


def anon(nbytes: int, src: np.ndarray, huge: bool) -> mmap.mmap:
    """Anonymous memory holding ``src``, advised to take (``huge``) or not to take 2 MiB pages."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        m.madvise(advice)
    np.frombuffer(m, dtype=np.uint8)[:] = src
    return m


def anon_huge_kib() -> int | None:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--down", default="Q8_0", choices=sorted(DOWN))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="timed passes per kind (median)")
    ap.add_argument("--calls", type=int, default=24, help="routings per pass (each runs every layer)")
    ap.add_argument("--dir", default=str(ROOT / ".cache"), help="folder of the temporary weight file")
    ap.add_argument("--gap_us", type=float, default=0.0,
                    help="the calling thread spins this long after each layer's call (not timed), as a model's "
                         "other work between two MoE calls: the kernel threads wait that long for the next one")
    args = ap.parse_args()

    rng = np.random.default_rng(1)
    g = ML.rand_weights("Q4_K", E * I, H, rng)
    u = ML.rand_weights("Q4_K", E * I, H, rng)
    d = ML.rand_weights(args.down, E * H, I, rng)
    blob = np.concatenate([g, u, d])
    nb = blob.nbytes
    cuts = (g.nbytes, g.nbytes + u.nbytes)
    pool = K.cpu_infer(args.threads)
    print(f"ISA tier {K.isa_tier()}, {args.threads} thread(s); layer {nb / 1e6:.0f} MB x {args.layers} per kind; "
          f"gate/up Q4_K, down {args.down}")

    before = anon_huge_kib()
    kinds: dict[str, list] = {"anon 4K": [anon(nb, blob, False) for _ in range(args.layers)]}
    after_4k = anon_huge_kib()
    kinds["anon THP"] = [anon(nb, blob, True) for _ in range(args.layers)]
    after_thp = anon_huge_kib()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    path = Path(args.dir) / f"weight-memory-{os.getpid()}.bin"
    try:
        with open(path, "wb") as f:
            for _ in range(args.layers):
                f.write(blob.tobytes())
        fd = os.open(path, os.O_RDONLY)
        fmap = mmap.mmap(fd, nb * args.layers, prot=mmap.PROT_READ)
        os.close(fd)
        kinds["file mmap"] = [memoryview(fmap)[i * nb:(i + 1) * nb] for i in range(args.layers)]
        with open(path, "rb") as f:  # through the page cache, as a warmed model file
            while f.read(1 << 24):
                pass
        if None not in (before, after_4k, after_thp):
            print(f"AnonHugePages: the 4K copies took {after_4k - before} kB, the THP copies {after_thp - after_4k} kB "
                  f"(of {args.layers * nb // 1024} kB each)")

        def kernels(bufs):
            out = []
            for b in bufs:
                a = np.frombuffer(b, dtype=np.uint8, count=nb)
                out.append(K.MoEKernel(pool, "llamafile", E, H, I, a[:cuts[0]], a[cuts[0]:cuts[1]], a[cuts[1]:],
                                       "Q4_K", "Q4_K", args.down))
            return out

        layers = {k: kernels(v) for k, v in kinds.items()}
        x = torch.randn(1, H) * 0.5
        out = torch.empty(1, H)
        routes = ML.routings(1, E, TOP_K, args.calls)
        bpw = lambda t: ML.BLOCK[t][1] / ML.BLOCK[t][0]  # noqa: E731 - bytes per weight
        hit = TOP_K * I * H * (2 * bpw("Q4_K") + bpw(args.down))
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        gap = args.gap_us * 1e-6
        for _ in range(args.reps + 1):  # the first pass warms up and is dropped
            for k, mods in layers.items():
                spent = 0.0
                for ids, w in routes:
                    for m in mods:
                        t0 = time.perf_counter()
                        m.forward(x, ids, w, out)
                        t1 = time.perf_counter()
                        spent += t1 - t0
                        while gap and time.perf_counter() - t1 < gap:  # the rest of a model's layer
                            pass
                rates[k].append(hit * len(routes) * len(mods) / spent / 1e9)
        probe = max(pool.probe_read_bw(1 << 29, 3) for _ in range(2))
        base = statistics.median(rates["anon 4K"][1:])
        print(f"DRAM read probe ({args.threads} threads): {probe:.1f} GB/s")
        print(f"{'memory':10s} {'GB/s':>6s} {'vs anon 4K':>10s} {'%probe':>7s}  passes")
        for k, v in rates.items():
            med = statistics.median(v[1:])
            print(f"{k:10s} {med:6.1f} {med / base:9.2f}x {100 * med / probe:6.0f}%  "
                  + " ".join(f"{r:.1f}" for r in v[1:]))
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
