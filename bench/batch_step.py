"""Cost of one BatchRunner step with N decoding sequences vs N single-sequence decode steps.

    python bench/batch_step.py [--arch qwen3_moe] [--small] [--threads 2] [--context 64] [--gguf FILE]

Builds a random model (``--small``: 4 layers, hidden 512, 32 experts top-4, vocab 1024 for the MoE;
otherwise the tests' tiny config), injects the shipped CPU rules, prefills N sequences of
``--context`` tokens and times decode steps (best of ``--rounds`` interleaved rounds of ``--steps`` steps).  Rows: N, ms per batched
step, ms per step of the single-request path (DynamicCache, one sequence), ratio to N single steps.
Each N is timed twice: the decode step over the pages (generation/decode_step.py, where it serves the
model) and the generic forward (``lean_decode = False``), same pages, same tokens.
With ``--hf`` also transformers' own continuous batching (``generate_batch``) end to end.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from e2e import best  # bench/e2e.py's best-of-N timer (bench/ is this script's folder)

SMALL = {
    "qwen3_moe": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                      vocab_size=1024, max_position_embeddings=1024),
    "llama": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1536, vocab_size=1024, max_position_embeddings=1024),
    "deepseek_v2": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                        moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4,
                        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                        vocab_size=1024, max_position_embeddings=1024),
    "gemma3_text": dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=1,
                        head_dim=64, intermediate_size=1536, vocab_size=1024, sliding_window=32,
                        max_position_embeddings=1024),
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3_moe", choices=sorted(SMALL))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gguf", help="a GGUF file instead of a random model (e.g. gemma-3-270m-q4_k_m.gguf)")
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate_batch")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import DynamicCache

    from ktransformers import load_model
    from ktransformers.generation.paged import BatchRunner
    from ktransformers.util.tiny_models import write_tiny_model

    if args.gguf:
        model = load_model(args.gguf)
        args.arch = args.gguf.rsplit("/", 1)[-1]
    else:
        d = tempfile.mkdtemp(prefix="bench-batch-")
        write_tiny_model(args.arch, d, seed=0, with_tokenizer=False, **(SMALL[args.arch] if args.small else {}))
        model = load_model(d, model_path=d)
    vocab = model.config.get_text_config().vocab_size
    ctx = args.context
    prompt = lambda i: torch.randint(0, vocab, (ctx,), generator=torch.Generator().manual_seed(i)).tolist()

    ns = [int(x) for x in args.batch.split(",")]
    # single-request path: one sequence, DynamicCache, one token per forward
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        nxt = model(torch.tensor([prompt(0)]), cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

    def single():
        nonlocal nxt
        with torch.no_grad():
            for _ in range(args.steps):
                nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)

    runners, lasts = {}, {}
    kinds = ("lean", "generic")
    for n in ns:
        for kind in kinds:
            runner = runners[n, kind] = BatchRunner(model, page_size=16,
                                                    num_pages=n * ((ctx + 2 * args.rounds * args.steps) // 16 + 2))
            runner.lean_decode = kind == "lean"
            lasts[n, kind] = {i: int(runner.step([(i, prompt(i))])[0].argmax()) for i in range(n)
                              if runner.begin(i) is None}

    def batched(key):
        runner, last, n = runners[key], lasts[key], key[0]

        def run():
            for _ in range(args.steps):
                logits = runner.step([(i, [last[i]]) for i in range(n)])
                for i in range(n):
                    last[i] = int(logits[i].argmax())
        return run

    # interleaved rounds, best of each: load drifting on a shared machine hits every row alike
    times = {"single": [], **{key: [] for key in runners}}
    for _ in range(args.rounds):
        times["single"].append(best(single, 1) / args.steps)
        for key in runners:
            times[key].append(best(batched(key), 1) / args.steps)
    t_single = min(times["single"])
    from ktransformers.generation.decode_step import decode_step_for

    step = decode_step_for(model)
    lean_used = step is not None and all(step.pages_of(r.pool) is not None for r in runners.values())
    print(f"{args.arch}{'' if args.gguf else ' small' if args.small else ' tiny'}, {args.threads} threads, context {ctx}: "
          f"single-request decode step {t_single * 1e3:.2f} ms"
          f"{'' if lean_used else ' (the decode step does not serve this model: both rows generic)'}")
    print(f"{'N':>3} {'step':>8} {'batched step ms':>16} {'ms/token':>9} {'vs N single steps':>18}")
    for n in ns:
        for kind in kinds:
            t = min(times[n, kind])
            print(f"{n:>3} {kind:>8} {t * 1e3:>16.2f} {t / n * 1e3:>9.2f} {t / (n * t_single):>17.2f}x")

    if args.hf:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        for n in [int(x) for x in args.batch.split(",")]:
            gc = GenerationConfig(max_new_tokens=args.steps, do_sample=False, eos_token_id=None)
            cb = ContinuousBatchingConfig(num_blocks=n * 16, page_size=16, max_batch_tokens=max(64, n * ctx))
            prompts = [prompt(i) for i in range(n)]
            model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb)
            t = best(lambda: model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb), 3)
            print(f"transformers generate_batch N={n}: {t * 1e3:.0f} ms for prefill + {args.steps} tokens each")

            runner = BatchRunner(model, page_size=16, num_pages=n * ((ctx + args.steps) // 16 + 2))

            def ours():
                last = {}
                for i in range(n):
                    runner.begin(i)
                logits = runner.step([(i, prompts[i]) for i in range(n)])
                last = {i: int(logits[i].argmax()) for i in range(n)}
                for _ in range(args.steps - 1):
                    logits = runner.step([(i, [last[i]]) for i in range(n)])
                    last = {i: int(logits[i].argmax()) for i in range(n)}
                for i in range(n):
                    runner.release(i)

            t = best(ours, 3)
            print(f"BatchRunner same work          N={n}: {t * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
