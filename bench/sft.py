"""LoRA training throughput and peak RSS: ours (training rules) vs transformers + PEFT.

    python bench/sft.py                                  # Qwen3-MoE shape, 2 layers, real dims
    python bench/sft.py --layers 4 --contenders peft,torch,kernels:llamafile,kernels:AMXBF16
    python bench/sft.py --tiny --steps 3                 # smoke run on the tiny model (seconds)

Model: a random Qwen3-MoE-shaped checkpoint (hidden 2048, 128 experts, top-8, expert
intermediate 768, 32 heads / 4 KV heads, head_dim 128, vocab ``--vocab``; ``--layers`` layers),
bf16 safetensors, written once into ``.cache/models``.  LoRA rank ``--rank`` on q/k/v/o and on the
experts' ``gate_up_proj`` / ``down_proj``.

Contenders, each in a fresh process (its own peak RSS), same random token batches, same threads:

* ``peft``: the unmodified transformers model (experts as plain bf16 torch parameters) with PEFT
  (``target_modules`` + ``target_parameters``) — the baseline;
* ``torch``: our loader with ``Qwen3Moe-sft-torch-cpu.yaml`` (experts in torch autograd);
* ``kernels:<backend>``: our loader with ``Qwen3Moe-sft-cpu.yaml`` (``KSFTExpertsCPU``, the CPU
  kernels' forward and backward), the rule's ``backend:`` set to ``<backend>``; ``--gguf FILE``
  trains on those quantized weights instead of the bf16 checkpoint.

Each step: forward of ``--batch`` x ``--seq`` tokens under bf16 autocast, cross-entropy on all
tokens, backward, AdamW on the LoRA parameters.  Printed: tokens/s (median over the steps after
``--warmup``), peak RSS, and both as ratios to the baseline (target: >= 3x tokens/s at <= 0.5x RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODELS = ROOT / ".cache" / "models"
SFT_RULES = ROOT / "ktransformers" / "optimize_rules" / "sft"

QWEN3_DIMS = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                  max_position_embeddings=4096)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# ------------------------------------------------------------------------------ the model


def model_dir(args) -> Path:
    name = "tiny-qwen3moe-sft" if args.tiny else f"qwen3moe-sft-L{args.layers}-V{args.vocab}"
    return MODELS / name


def make_model(path: Path, tiny: bool, layers: int, vocab: int) -> None:
    """Write the random checkpoint (runs in its own process: keeps the bench's RSS small)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ktransformers.util.tiny_models import tiny_config

    dims = {} if tiny else dict(QWEN3_DIMS, num_hidden_layers=layers, vocab_size=vocab)
    cfg = tiny_config("qwen3_moe", **dims)
    cfg.dtype = torch.bfloat16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".tmp"))
    model.save_pretrained(tmp)
    tmp.rename(path)


# ------------------------------------------------------------------------------ one contender


def build(contender: str, path: Path, rank: int, gguf: str | None):
    """(model, trainable parameters) for ``contender``."""
    import torch

    if contender == "peft":
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
        model.requires_grad_(False)
        pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION,
                                              target_parameters=EXPERTS))
        return pm, [p for p in pm.parameters() if p.requires_grad]
    from peft import LoraConfig

    from ktransformers.sft import torch_experts  # noqa: F401 - the torch operator's registration
    from ktransformers.sft.adapter import expert_modules, wrap_linears
    from ktransformers.util.loading import load_model

    if contender == "torch":
        rules = (SFT_RULES / "Qwen3Moe-sft-torch-cpu.yaml").read_text()
    else:
        backend = contender.partition(":")[2] or "llamafile"
        rules = (SFT_RULES / "Qwen3Moe-sft-cpu.yaml").read_text().replace("backend: llamafile", f"backend: {backend}")
    model = load_model(gguf or path, path, rules, dtype=torch.bfloat16, device="cpu")
    model.requires_grad_(False)
    wrap_linears(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION))
    for m in expert_modules(model).values():
        m.add_lora(rank, 2 * rank, 0.0, ("gate_up_proj", "down_proj"))
    model.train()
    return model, [p for p in model.parameters() if p.requires_grad]


def worker(args) -> None:
    import resource

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    try:
        from ktransformers.operators.cpu_threads import set_cpu_infer_threads

        set_cpu_infer_threads(args.threads)
    except ImportError:
        pass
    t0 = time.perf_counter()
    model, params = build(args.worker, Path(args.model), args.rank, args.gguf)
    load_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    steady = sorted(times[args.warmup:])
    median = steady[len(steady) // 2]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"contender": args.worker, "tokens_per_s": args.batch * args.seq / median,
                      "step_s": median, "peak_rss_mib": rss, "load_s": load_s, "first_loss": losses[0],
                      "trainable": sum(p.numel() for p in params)}))


# ------------------------------------------------------------------------------ the bench


def run_worker(args, contender: str, path: Path) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", contender, "--model", str(path), "--rank", str(args.rank),
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    if args.gguf and contender.startswith("kernels"):
        cmd += ["--gguf", args.gguf]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{contender:<20} skipped: {tail}")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contenders", default="peft,torch,kernels:llamafile",
                   help="comma-separated: peft (baseline, first), torch, kernels:<backend>")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tiny", action="store_true", help="the tiny model (smoke run)")
    p.add_argument("--gguf", help="quantized weights for the kernels contenders (same shape)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    path = model_dir(args)
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", flush=True)
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import importlib.util as u; "
                "s = u.spec_from_file_location('b', sys.argv[2]); b = u.module_from_spec(s); s.loader.exec_module(b); "
                "b.make_model(Path(sys.argv[3]), sys.argv[4] == '1', int(sys.argv[5]), int(sys.argv[6]))")
        subprocess.run([sys.executable, "-c", code, str(ROOT), __file__, str(path), "1" if args.tiny else "0",
                        str(args.layers), str(args.vocab)], check=True)
    print(f"model {path.name}; batch {args.batch} x {args.seq} tokens, LoRA r={args.rank} on "
          f"{'/'.join(ATTENTION)} + experts; {args.threads} threads; median of {args.steps} steps")
    base = None
    print(f"{'contender':<20} {'tokens/s':>10} {'step s':>8} {'peak RSS MiB':>13} {'x tokens/s':>11} {'x RSS':>7}")
    for c in [s.strip() for s in args.contenders.split(",") if s.strip()]:
        r = run_worker(args, c, path)
        if r is None:
            continue
        if c == "peft":
            base = r
        rt = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        rr = f"{r['peak_rss_mib'] / base['peak_rss_mib']:.2f}" if base else "-"
        print(f"{c:<20} {r['tokens_per_s']:>10.1f} {r['step_s']:>8.3f} {r['peak_rss_mib']:>13.0f} {rt:>11} {rr:>7}",
              flush=True)
    try:
        import kt_kernel  # noqa: F401

        print("kt-kernel is installed; its SFT MoE is not wired into this bench yet")
    except ImportError:
        print("kt-kernel: not installed (its SFT MoE row skipped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
