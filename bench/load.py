"""GGUF load benchmark: write a >= 2 GB Qwen3-MoE-shaped GGUF with the converter, then load it.

    python bench/load.py [--out .cache/bench] [--keep-dense-dtype bfloat16]

Model: 4 layers, hidden 2048, 32 heads / 4 KV heads (head_dim 128), 128 experts (top 8), expert
intermediate 768, vocab 151936.  Experts Q4_K, attention and embeddings/output Q8_0, norms and
routers F32 (about 2.1 GB).  The file is written once through the converter's own code path
(:func:`ktransformers.convert.plan` + :func:`ktransformers.convert.write_gguf`) from a synthetic
random checkpoint; to keep writing fast on small machines the Q4_K bytes of a pool of 8 random
experts per projection are reused for all 128 experts (loading cost does not depend on values).

Load (in a fresh subprocess, so RSS is clean): open the GGUF, build the HF model on the meta device
from the GGUF metadata, dequantize every non-expert tensor into ``--dense-dtype`` and take the
routed experts as raw zero-copy views (what a quantized CPU kernel uses; their pages are touched
once, as a kernel's first pass would).  Prints wall time, GB/s of file bytes, and peak RSS above
the pre-load baseline relative to the resident weight bytes (dequantized + raw expert bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DIMS = dict(
    num_hidden_layers=4, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
    vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=False,
)


class SyntheticCheckpoint:
    """Random tensors on demand, with the Checkpoint interface the converter plans with."""

    path = Path("<synthetic>")

    def __init__(self, model):
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def has(self, name):
        return True

    def get(self, name):
        g = torch.Generator().manual_seed(hash(name) % (2**31))
        shape = self.shapes[name]
        if len(shape) == 1:
            return 1.0 + 0.1 * torch.randn(shape, generator=g)
        return 0.02 * torch.randn(shape, generator=g)

    def expert(self, base, proj, e, n_inter):
        raise AssertionError("experts come from the pooled producer")


def write(path: Path) -> None:
    from transformers import Qwen3MoeConfig

    from ktransformers.convert import TypePolicy, _meta_model, metadata_for, plan, write_gguf
    from ktransformers.weights.quantize import quantize

    cfg = Qwen3MoeConfig(**DIMS)
    ckpt = SyntheticCheckpoint(_meta_model(cfg))
    policy = TypePolicy(experts="Q4_K", attention="Q8_0", default="Q8_0")
    arch, outs = plan(cfg, ckpt, policy)
    pool = 8
    for o in outs:
        if o.name.endswith("_exps.weight"):
            E, rows, cols = o.shape

            def produce(o=o, E=E, rows=rows, cols=cols):
                g = torch.Generator().manual_seed(hash(o.name) % (2**31))
                chunks = [quantize(0.02 * torch.randn(rows, cols, generator=g), o.ggml_type) for _ in range(pool)]
                return np.concatenate([chunks[e % pool] for e in range(E)])

            o.produce = produce
    md = metadata_for(cfg, arch, [o.name for o in outs])
    md["general.name"] = ("str", "bench-qwen3moe-4L")
    t = time.time()
    write_gguf(path, md, outs, log=lambda s: print("  " + s, file=sys.stderr) if "exps" in s else None)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.time() - t:.0f}s", file=sys.stderr)


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(path: Path, dense_dtype: torch.dtype) -> dict:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from ktransformers.weights.gguf_source import GGUFSource

    base_rss = rss_now()
    t0 = time.perf_counter()
    src = GGUFSource(path)
    cfg = src.config()
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg)
    t_open = time.perf_counter() - t0
    dense_bytes = raw_bytes = 0
    state = {}
    raws = []
    for name, p in model.state_dict().items():
        if ".mlp.experts." in name:
            base = name.rsplit(".", 1)[0]
            projs = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            for proj in projs:
                r = src.raw(f"{base}.{proj}")
                _ = int(r.data[::4096].sum())  # a kernel's first pass touches every page
                raws.append(r)
                raw_bytes += r.nbytes
            continue
        t = src.tensor(name, dtype=dense_dtype)
        src.release(name)
        state[name] = t
        dense_bytes += t.numel() * t.element_size()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    file_bytes = sum(f.stat().st_size for f in src.files)
    resident = dense_bytes + raw_bytes
    return dict(
        file_gb=file_bytes / 1e9, open_s=t_open, wall_s=wall, gb_per_s=file_bytes / 1e9 / wall,
        dense_gb=dense_bytes / 1e9, raw_expert_gb=raw_bytes / 1e9, resident_gb=resident / 1e9,
        baseline_rss_gb=base_rss / 1e9, peak_rss_gb=peak / 1e9, end_rss_gb=rss_now() / 1e9,
        peak_over_baseline_vs_resident=(peak - base_rss) / resident, threads=torch.get_num_threads(),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--dense-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rewrite", action="store_true", help="write the GGUF again even if it exists")
    ap.add_argument("--_load", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._load:
        print(json.dumps(load(Path(a._load), getattr(torch, a.dense_dtype))))
        return 0
    path = Path(a.out) / "qwen3moe-4L-128e-q4k.gguf"
    if a.rewrite or not path.is_file():
        write(path)
    r = subprocess.run([sys.executable, __file__, "--_load", str(path), "--dense-dtype", a.dense_dtype],
                       capture_output=True, text=True)
    if r.returncode:
        print(r.stderr, file=sys.stderr)
        return r.returncode
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"file                {res['file_gb']:.2f} GB  ({path})")
    print(f"open + config + meta model  {res['open_s']:.2f} s")
    print(f"load wall time      {res['wall_s']:.2f} s  ({res['gb_per_s']:.2f} GB/s of file bytes)")
    print(f"resident weights    {res['resident_gb']:.2f} GB  (dense {a.dense_dtype} {res['dense_gb']:.2f} GB "
          f"+ raw Q4_K experts {res['raw_expert_gb']:.2f} GB, zero-copy)")
    print(f"RSS                 baseline {res['baseline_rss_gb']:.2f} GB, peak {res['peak_rss_gb']:.2f} GB, "
          f"end {res['end_rss_gb']:.2f} GB")
    print(f"peak RSS above baseline / resident weights = {res['peak_over_baseline_vs_resident']:.2f}x  (target <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
