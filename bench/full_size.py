"""Full-size Qwen3-30B-A3B-shaped model: load, prefill and decode, ours next to llama.cpp.

    .venv/bin/python bench/full_size.py --llama_cpp_bin DIR                # 48 layers, prefill 512, decode 32
    .venv/bin/python bench/full_size.py --layers 4 --llama_cpp_bin DIR     # the same pipeline on a small file
    .venv/bin/python bench/full_size.py --prefill 512,4096 --decode 16 --timeout 900
    .venv/bin/python bench/full_size.py --shape deepseek-v2-lite --llama_cpp_bin DIR

The model (written once into .cache/models/, ~17.3 GiB at 48 layers): arch ``qwen3moe``, hidden
2048, 32 heads / 4 KV heads of 128, 128 experts, top-8, expert FFN 768, vocab 151936, rope theta
1e6, context 40960; names and metadata from ``ktransformers.convert`` (``plan``/``metadata_for``/
``write_gguf``), a placeholder vocabulary (bench/e2e.py), and llama-quantize's Q4_K_M type mix
(``convert.PresetPolicy``): Q4_K for attn_q/k/output, gate/up experts and token_embd; Q6_K for
output, and for attn_v and the down experts in half the layers (the first and last eighth and
every third in between; Q4_K in the others); F32 for norms and routers.
``--shape deepseek-v2-lite`` writes a DeepSeek-V2-Lite-shaped file instead (27 layers, MLA with
kv_lora_rank 512 and no q LoRA, 16 heads, 64 routed experts + 2 shared, top-6, expert FFN 1408,
the first layer dense, vocab 102400, YaRN rope; the same preset, whose types for rows of 1408 fall
back as llama-quantize's do: Q5_0 / Q8_0).  The quantized tensors are
random valid blocks written directly (slices of one random buffer per type, fp16 scales set to
normal values that give the weights an rms of ~0.02); norms ~1, routers small.  Each of our runs
checks that its logits are finite.

Rows, in this order, each side in its own process under ``/usr/bin/time -v``, same file and threads:
* load: wall seconds from process start to the first token's logits (ours: ``load_model`` + a
  one-token prefill; llama.cpp: ``llama-bench -p 1 -n 0 -r 1``);
* decode N (--decode) at depth 0: tok/s (ours: ``Generator.generate`` from a one-token prompt,
  N decode steps; llama.cpp: ``llama-bench -p 0 -n N``);
* decode N at depth D for D in --depth: tok/s of N decode steps after a D-token prompt, one run
  (ours: ``Generator.generate`` of a D-token prompt; llama.cpp: ``llama-bench -p 0 -n N -d D``);
* prefill P for P in --prefill: tok/s, best of --repeats after a short warm-up (ours:
  ``Generator.prefill``; llama.cpp: ``llama-bench -p P -n 0``).
``--gguf FILE`` runs the same rows on another file (the long-context rows use Gemma-3-270M Q4_K_M:
``--gguf .cache/models/gemma-3-270m-q4_k_m.gguf --prefill 8192,32000 --depth 8192,32000``).
Each row also gives both sides' peak RSS (mapped file pages touched included).  Before each
measured process (ours and llama.cpp's) the file is read through the page cache (``warm``; off
with ``--no-warm``): a VM that pages out idle file pages would otherwise make a row's speed depend
on how long the file sat unread before it.
Without ``--llama_cpp_bin`` (or ``KT_LLAMA_CPP_BIN``) only our rows print.
Last, the decode roofline: the bytes a depth-0 decode step must read from the file (every tensor
once, the routed experts top-k of E, the embedding rows a lookup) against the DRAM read probe of
our process -- the most tok/s any engine can reach on this machine -- and both sides' share of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from e2e import MODELS, _NullTokenizer, _placeholder_vocab, llama_bench_dir  # bench/ is on sys.path

#: bench shapes: (transformers model_type, GGUF arch, architectures, config, default layers)
SHAPES = {
    "qwen3moe-30b-a3b": ("qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 48),
    # MLA (kv_lora_rank 512, no q LoRA), 64 routed experts + 2 shared, top-6, the first layer dense
    "deepseek-v2-lite": ("deepseek_v2", "deepseek2", "DeepseekV2ForCausalLM", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, intermediate_size=10944,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, vocab_size=102400, max_position_embeddings=163840, rms_norm_eps=1e-6, norm_topk_prob=False,
        routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "beta_fast": 32.0, "beta_slow": 1.0}), 27),
}
LLAMA_FTYPE_Q4_K_M = 15
BUFFER_BYTES = 256 << 20


def model_path(shape: str, layers: int) -> Path:
    return MODELS / f"bench-{shape}-shape-{layers}l-q4km.gguf"


def random_blocks(t: str, rng: np.random.Generator) -> np.ndarray:
    """~256 MiB of random but valid ``t`` blocks (flat uint8); any block-aligned slice is valid.
    Each type's fp16 scales are normal numbers that give the weights an rms of ~0.02.

    Q4_K (d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles): w = d*sc*q - dmin*m with
    sc, m in [0, 63], q in [0, 15]; dmin = 7.5 d centres the weights, d = 8e-5.
    Q5_K (d, dmin, 12 bytes of scales/mins, 32 bytes of high bits, 128 of nibbles): q in [0, 31],
    dmin = 15.5 d, d = 5e-5.
    Q6_K (128 + 64 bytes of 6-bit q - 32, 16 int8 scales, d): scales drawn from [-32, 31] so that
    d = 6.5e-5 (just above fp16's smallest normal).
    Q5_0 (d, 4 bytes of high bits, 16 of nibbles): w = d*(q - 16), d = 2.2e-3.
    Q8_0 (d, 32 int8): w = d*q, d = 2.7e-4."""
    bb = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q5_0": 22, "Q8_0": 34}.get(t)
    if bb is None:
        raise SystemExit(f"bench/full_size.py: no random-block writer for {t}")
    raw = rng.integers(0, 256, size=(BUFFER_BYTES // bb, bb), dtype=np.uint8)
    f16 = lambda v: np.full(len(raw), v, np.float16).view(np.uint8).reshape(-1, 2)  # noqa: E731
    if t == "Q4_K":
        raw[:, 0:2], raw[:, 2:4] = f16(8e-5), f16(6e-4)
    elif t == "Q5_K":
        raw[:, 0:2], raw[:, 2:4] = f16(5e-5), f16(7.75e-4)
    elif t == "Q6_K":
        raw[:, 192:208] = ((raw[:, 192:208] & 0x3F).astype(np.int8) - 32).view(np.uint8)
        raw[:, 208:210] = f16(6.5e-5)
    elif t == "Q5_0":
        raw[:, 0:2] = f16(2.2e-3)
    else:
        raw[:, 0:2] = f16(2.7e-4)
    return raw.reshape(-1)


class _Shapes:
    """What ``convert.plan`` asks of a checkpoint; every tensor's data comes from our producers.
    Every tensor of the model's own layers is there; no MTP layer (``model.layers.{n}``)."""

    path = Path("<random>")
    keys = ()

    def __init__(self, config):
        self._mtp = f"model.layers.{int(config.num_hidden_layers)}."

    def has(self, name):
        return not name.startswith(self._mtp)


def plan_model(shape: str, layers: int):
    """(config, GGUF arch, ``convert.plan``'s outputs) of the bench model: what ``write_model``
    writes, planned without writing (tests/util/test_bench_models.py checks it for every shape)."""
    from transformers import AutoConfig

    from ktransformers import convert as kc

    model_type, gguf_arch, architecture, config, _ = SHAPES[shape]
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=layers, **config)
    cfg.architectures = [architecture]
    arch, outs = kc.plan(cfg, _Shapes(cfg), kc.PresetPolicy.for_config("Q4_K_M", cfg, gguf_arch))
    return cfg, arch, outs


def write_model(shape: str, layers: int) -> Path:
    from ktransformers import convert as kc
    from ktransformers.weights.ggml_types import ggml_type_info

    p = model_path(shape, layers)
    if p.is_file():
        print(f"model: {p} ({p.stat().st_size / 2**30:.2f} GiB, cached)", flush=True)
        return p
    cfg, arch, outs = plan_model(shape, layers)
    rng = np.random.default_rng(0)
    buffers = {}
    for o in outs:
        if o.ggml_type != "F32":
            buf = buffers.get(o.ggml_type)
            if buf is None:
                buf = buffers[o.ggml_type] = random_blocks(o.ggml_type, rng)
            bb = ggml_type_info(o.ggml_type).block_bytes
            start = int(rng.integers(0, (len(buf) - o.nbytes) // bb + 1)) * bb
            o.produce = lambda buf=buf, a=start, n=o.nbytes: buf[a:a + n]
        elif len(o.shape) == 1:  # norms
            o.produce = lambda s=o.shape, r=np.random.default_rng(len(o.name)): \
                (1.0 + 0.05 * r.standard_normal(s)).astype(np.float32)
        else:  # router
            o.produce = lambda s=o.shape, r=np.random.default_rng(len(o.name)): \
                (0.02 * r.standard_normal(s)).astype(np.float32)
    md = kc.metadata_for(cfg, arch, [o.name for o in outs])
    md["general.name"] = ("str", f"bench-{shape}-shaped")
    md["general.file_type"] = ("u32", LLAMA_FTYPE_Q4_K_M)
    md.update(_placeholder_vocab(cfg.vocab_size))
    print(f"writing {p} ...", flush=True)
    t0 = time.perf_counter()
    kc.write_gguf(p, md, outs)
    print(f"written in {time.perf_counter() - t0:.0f} s: {p.stat().st_size / 2**30:.2f} GiB "
          f"({p.stat().st_size} bytes)", flush=True)
    return p


# ---------------------------------------------------------------------------------- running


def timed_run(cmd: list[str], timeout: float | None) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``: its stdout, exit status, wall seconds, peak RSS (GB)."""
    p = subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        status = None
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        status = f"timed out after {timeout:.0f} s"
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    wall = re.search(r"Elapsed \(wall clock\) time .*: (?:(\d+):)?(\d+):([\d.]+)", err)
    sig = re.search(r"Command terminated by signal (\d+)", err)
    if status is None and (sig or p.returncode):
        status = f"killed by signal {sig.group(1)}" if sig else f"exit {p.returncode}"
        tail = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("\t")][-2:]
        print(f"note: {' '.join(cmd[:4])} ... {status}: {' | '.join(tail)[-300:]}", flush=True)
    return {"out": out, "status": status, "rss_gb": int(rss.group(1)) * 1024 / 1e9 if rss else None,
            "wall_s": (int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3)))
            if wall else None}


def warm(path: Path) -> None:
    """Read the file through the page cache.  Run before each measured process (both sides): some
    VMs' memory managers page out file pages left unread for about a minute (DAMON ``pageout``,
    /sys/kernel/mm/damon), and a process then reads part of the model from disk -- its speed would
    depend on how long the file sat idle before it, not on the code."""
    buf = bytearray(1 << 24)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def ours(path: Path, job: str, args, repeats: int) -> dict:
    if args.warm:
        warm(path)
        cache = os.environ.get("KT_PACKED_CACHE")
        if args.backend and args.backend != "llamafile" and cache and Path(cache).is_dir():
            for f in sorted(Path(cache).rglob("*.ktpack")):  # what a packed backend reads instead, last
                warm(f)
    r = timed_run([sys.executable, __file__, "--child", job, "--model", str(path), "--threads", str(args.threads),
                   "--repeats", str(repeats), *(["--backend", args.backend] if args.backend else [])], args.timeout)
    for line in r["out"].splitlines():
        if line.startswith("RESULT "):
            r.update(json.loads(line[7:]))
    return r


def llama(path: Path, p: int, n: int, args, repeats: int, depth: int = 0) -> dict:
    if args.warm:
        warm(path)
    cmd = [str(args.llama_bin / "llama-bench"), "-m", str(path), "-p", str(p), "-n", str(n), "-t", str(args.threads),
           "-r", str(repeats), "-o", "json", *(["-d", str(depth)] if depth else []), *args.llama_args.split()]
    r = timed_run(cmd, args.timeout)
    if r["status"] is None:
        row = json.loads(r["out"])[0]
        r["tps"], r["sd"] = row["avg_ts"], row["stddev_ts"]
    return r


def rules_for_backend(path: str, backend: str | None):
    """The shipped CPU rule file of the model with its experts on ``backend`` (None: as shipped)."""
    if not backend or backend == "llamafile":
        return None
    from ktransformers.optimize_rules import default_rule_file
    from ktransformers.loading import load_config
    from ktransformers.weights import open_weights

    text = Path(default_rule_file(load_config(None, open_weights(path)), cuda=False)).read_text()
    if "backend: llamafile" not in text:
        raise SystemExit("bench/full_size.py: the shipped rule file names no llamafile backend to replace")
    return text.replace("backend: llamafile", f"backend: {backend}")


def child(args) -> int:
    """One of our measurements in this process: ``load``, ``prefill:P``, ``decode:N`` or ``depth:D:N``."""
    import torch

    from ktransformers import load_model
    from ktransformers.generation import Generator, SamplingParams
    from ktransformers.operators.cpu_threads import use_threads

    use_threads(args.threads)
    t0 = time.perf_counter()
    model = load_model(args.model, rules=rules_for_backend(args.model, args.backend))
    res = {"load_model_s": time.perf_counter() - t0}
    gen = Generator(model, _NullTokenizer())
    gen.eos_ids = set()
    job, _, n = args.child.partition(":")
    if job == "load":
        logits = gen.prefill([100], gen.new_cache(2))
        import ktransformers.kernels as K

        res["dram_gbs"] = K.cpu_infer(args.threads).probe_read_bw(1 << 28, 3)
    elif job == "prefill":
        ids = [int(i) for i in np.random.default_rng(0).integers(100, 30000, int(n))]
        gen.prefill(ids[:16], gen.new_cache(32))  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            logits = gen.prefill(ids, gen.new_cache(len(ids) + 1))
            best = min(best, time.perf_counter() - t0)
        res["tps"] = len(ids) / best
    elif job == "depth":  # N decode steps after a D-token prompt (the prompt not timed)
        d, _, n = n.partition(":")
        ids = [int(i) for i in np.random.default_rng(0).integers(100, 30000, int(d))]
        rates = []
        for _ in range(args.repeats):
            gen.generate(ids, SamplingParams(max_new_tokens=int(n) + 1))
            rates.append(gen.last_stats.decode_tps)
        res["tps"] = max(rates)
        logits = gen.prefill([100, 101], gen.new_cache(3))
    else:
        gen.generate([100], SamplingParams(max_new_tokens=4))  # warm-up
        rates = []
        for _ in range(args.repeats):
            gen.generate([100], SamplingParams(max_new_tokens=int(n) + 1))
            rates.append(gen.last_stats.decode_tps)
        res["tps"] = max(rates)
        logits = gen.prefill([100, 101], gen.new_cache(3))
    res["finite"] = bool(torch.isfinite(logits).all())
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def machine_line(dram_gbs: float | None) -> str:
    try:
        from ktransformers.kernels import isa_tier

        tier = isa_tier()
    except (ImportError, ValueError) as e:
        tier = f"? ({e})"
    info = Path("/proc/cpuinfo").read_text()
    field = lambda k: (re.search(rf"^{k}\s*:\s*(.*)$", info, re.M) or [None, "?"])[1]  # noqa: E731
    dram = f", DRAM read probe {dram_gbs:.1f} GB/s" if dram_gbs else ""
    return (f"machine: {field('model name')} (family {field('cpu family')}, model {field('model')}), "
            f"{os.cpu_count()} CPUs, ISA tier {tier}{dram}")


def decode_read_bytes(path: Path) -> tuple[float, str]:
    """Bytes a decode step must read from the file at depth 0, and how they were counted: every
    tensor once (the token embedding only where the output head is tied to it: its rows are a
    lookup), the routed experts' tensors (``*_exps``) by ``expert_used_count / expert_count``
    (one token reads top-k of E experts a layer).  The lower bound of any engine's per-token
    traffic on a memory-bound CPU decode, whatever its kernels (the KV cache at depth 0 is a few kB)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")

    def meta(key):
        f = r.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else None

    used, count = meta("expert_used_count"), meta("expert_count")
    names = {t.name for t in r.tensors}
    total = 0.0
    for t in r.tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        if "_exps." in t.name and used and count:
            n = n * used / count
        total += n
    how = "every tensor once, the embedding rows a lookup" + (
        f", routed experts {used} of {count}" if used and count else "")
    return total, how


def roofline_line(path: Path, dram_gbs: float | None, ours_tps: float | None, llama_tps: float | None) -> str:
    """The decode roofline of ``path`` at the DRAM read probe: the most tok/s any engine can decode
    at depth 0 if it reads each byte once at the probe's rate, and where both sides stand."""
    if not dram_gbs:
        return "decode roofline: no DRAM probe"
    nbytes, how = decode_read_bytes(path)
    top = dram_gbs * 1e9 / nbytes
    line = (f"decode roofline: {nbytes / 1e9:.2f} GB read a token ({how}); at the probe's {dram_gbs:.1f} GB/s "
            f"at most {top:.2f} tok/s")
    if ours_tps:
        line += f"; ours {ours_tps:.2f} = {100 * ours_tps / top:.0f} %"
    if llama_tps:
        line += (f"; llama.cpp {llama_tps:.2f} = {100 * llama_tps / top:.0f} %; 1.5x llama.cpp would be "
                 f"{1.5 * llama_tps:.2f} tok/s = {150 * llama_tps / top:.0f} % of the roofline")
    return line


# -------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3moe-30b-a3b", choices=sorted(SHAPES),
                    help="the model shape written (default qwen3moe-30b-a3b)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the model file (default: the shape's)")
    ap.add_argument("--prefill", default="512", help="comma list of prompt lengths (e.g. 512,4096,16384)")
    ap.add_argument("--decode", type=int, default=32, help="tokens for the decode rows")
    ap.add_argument("--depth", default="", help="comma list of cache depths for decode rows (e.g. 4096,16384); "
                    "one run each (a prompt of that length is prefilled first)")
    ap.add_argument("--gguf", help="measure this GGUF instead of writing the Qwen3-30B-A3B-shaped one "
                    "(e.g. Gemma-3-270M for the long-context rows)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="best of N (ours) / llama-bench -r N")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per measured process")
    ap.add_argument("--llama_cpp_bin", default=os.environ.get("KT_LLAMA_CPP_BIN"),
                    help="folder with llama.cpp's llama-bench (default: $KT_LLAMA_CPP_BIN)")
    ap.add_argument("--llama_args", default="", help="extra llama-bench flags, e.g. '--repack 0'")
    ap.add_argument("--no-warm", dest="warm", action="store_false",
                    help="do not read the file through the page cache before each measured process")
    ap.add_argument("--backend", help="our experts' backend (default: the rule file's llamafile); a packed one "
                    "(AMXInt8 / AMXBF16 / AMXInt4 / AMXInt4_1) adds rows for a load that packs and caches, then one "
                    "that maps the cache (KT_PACKED_CACHE, default .cache/packed-bench)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    args.llama_bin = llama_bench_dir(args.llama_cpp_bin)
    args.layers = args.layers or SHAPES[args.shape][4]
    path = Path(args.gguf) if args.gguf else write_model(args.shape, args.layers)

    # decode before the prefills: a long prefill's memory can push the file out of the page cache
    jobs = []
    if args.backend and args.backend != "llamafile":
        import shutil

        cache = Path(os.environ.setdefault("KT_PACKED_CACHE", str(MODELS.parent / "packed-bench")))
        shutil.rmtree(cache, ignore_errors=True)
        jobs += [(f"load, {args.backend} packed and cached", "load", (1, 0, 1)),
                 (f"load, {args.backend} from the cache", "load", (1, 0, 1))]
    else:
        jobs += [("load", "load", (1, 0, 1))]
    jobs += [(f"decode {args.decode}", f"decode:{args.decode}", (0, args.decode, args.repeats))]
    jobs += [(f"decode {args.decode} at depth {d}", f"depth:{d}:{args.decode}", (0, args.decode, 1, d))
             for d in map(int, filter(None, args.depth.split(",")))]
    jobs += [(f"prefill {p}", f"prefill:{p}", (p, 0, args.repeats)) for p in map(int, filter(None, args.prefill.split(",")))]
    rows, dram, load0 = [], None, os.getloadavg()[0]
    for label, job, (p, n, r, *depth) in jobs:
        print(f"running {label} ...", flush=True)
        a = ours(path, job, args, repeats=1 if depth else args.repeats)
        dram = dram or a.get("dram_gbs")
        if a.get("finite") is False:
            print(f"warning: our logits are not finite ({label})")
        rows.append((label, a, llama(path, p, n, args, r, *depth) if args.llama_bin else None))

    print(f"\n{machine_line(dram)}; load average (1 min) {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print(f"model: {path.name} ({path.stat().st_size / 2**30:.2f} GiB"
          f"{'' if args.gguf else f', {args.layers} layers'}), our experts' backend {args.backend or 'llamafile'}, "
          f"threads {args.threads}" + (f", llama-bench in {args.llama_bin}" if args.llama_bin else ""))
    print("\n| row | ktransformers | llama.cpp | ours/llama.cpp | peak RSS ours | peak RSS llama.cpp "
          "| RSS ours/llama.cpp |\n|---|---|---|---|---|---|---|")
    for label, a, b in rows:
        key, unit = ("wall_s", "s") if label.startswith("load") else ("tps", "tok/s")
        va, vb = (x.get(key) if x and not x["status"] else None for x in (a, b))
        ra, rb = (x["rss_gb"] if x and not (x["status"] or "").startswith("exit") else None for x in (a, b))
        sa, sb = (f"{v:.2f} {unit}" if v else (x or {}).get("status") or "n/a" for v, x in ((va, a), (vb, b)))
        if vb and b.get("sd"):
            sb = sb.replace(" ", f" ± {b['sd']:.2f} ", 1)
        if label.startswith("load") and va:
            sa += f" (load_model {a['load_model_s']:.1f} s)"
        ratio = lambda u, v: f"{u / v:.2f}" if u and v else "n/a"  # noqa: E731
        gb = lambda v: f"{v:.2f} GB" if v else "n/a"  # noqa: E731
        print(f"| {label} | {sa} | {sb} | {ratio(va, vb)} | {gb(ra)} | {gb(rb)} | {ratio(ra, rb)} |")
    print("\n(load: lower is better; prefill/decode: higher is better; RSS: lower is better)")
    dec = next(((a, b) for label, a, b in rows if label == f"decode {args.decode}"), None)
    if dec is not None:
        tps = [x.get("tps") if x and not x["status"] else None for x in dec]
        print(roofline_line(path, dram, *tps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
