"""LoRA training throughput and peak RSS: ours (training rules) vs transformers + PEFT.

    python bench/sft.py                                  # Qwen3-MoE layer dims, 2 layers, vocab 8192
    python bench/sft.py --layers 4 --contenders peft,torch,kernels:llamafile,kernels:AMXBF16
    python bench/sft.py --dtype fp32                     # fp32 torch weights, no autocast (every contender)
    python bench/sft.py --tiny --steps 3                 # smoke run on the tiny model (seconds)

Model: a random Qwen3-MoE-shaped checkpoint with the real layer dims of Qwen3-MoE-30B-A3B
(hidden 2048, 128 experts, top-8, expert intermediate 768, 32 heads / 4 KV heads, head_dim 128),
``--layers`` layers and vocabulary ``--vocab`` (reduced from the real 151936 by default: the
head's matmuls would otherwise dominate every contender's step alike), bf16 safetensors, written
once into ``.cache/models``.  LoRA rank ``--rank`` on q/k/v/o and on the experts'
``gate_up_proj`` / ``down_proj``.

Contenders, each in a fresh process (its own peak RSS, ``ru_maxrss``), same random token
batches, same threads, each stopped after ``--time-limit`` seconds (load included) and then
reported as "did not finish" with what it did by then:

* ``peft``: the unmodified transformers model (experts as plain torch parameters, ``--dtype``)
  with PEFT (``target_modules`` + ``target_parameters``) — the baseline;
* ``torch``: our loader with ``Qwen3Moe-sft-torch-cpu.yaml`` (experts in torch autograd);
* ``kernels:<backend>``: our loader with ``Qwen3Moe-sft-cpu.yaml`` (``KSFTExpertsCPU``, the CPU
  kernels' forward and backward), the rule's ``backend:`` set to ``<backend>``; ``--gguf FILE``
  trains on those quantized weights instead of the bf16 checkpoint.

Each step: forward of ``--batch`` x ``--seq`` tokens, cross-entropy on all tokens, backward,
AdamW on the LoRA parameters; ``--dtype bf16`` (the default): torch-side weights (the
baseline's experts included) in bf16 under bf16 autocast, ``fp32``: fp32 weights, no autocast;
the kernels contenders' experts are bf16 (a ``--gguf`` file's: its types) either way.  On CPUs
without bf16 instructions torch emulates bf16 matmuls and its backward's ``grad @ weight``
layout crawls (docs/sft.md), which slows every contender's torch side in ``bf16``.  Printed: tokens/s (median over the ``--steps`` steps after
``--warmup``), peak RSS, both as ratios to the baseline, and whether the targets (>= 3x the
baseline's tokens/s at <= 0.5x its peak RSS) are met.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
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
    """Write the random checkpoint."""
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


def build(contender: str, path: Path, rank: int, gguf: str | None, dtype):
    """(model, trainable parameters) for ``contender``, torch-side weights in ``dtype``."""
    import torch

    if contender == "peft":
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
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
    # experts into the kernels as bf16 (this checkpoint's type; a --gguf file's own), the torch side in dtype
    model = load_model(gguf or path, path, rules, dtype=torch.bfloat16, device="cpu")
    model.to(dtype)
    model.requires_grad_(False)
    wrap_linears(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION))
    for m in expert_modules(model).values():
        m.add_lora(rank, 2 * rank, 0.0, ("gate_up_proj", "down_proj"))
    model.train()
    return model, [p for p in model.parameters() if p.requires_grad]


def _report(**fields) -> None:
    """One progress line to the bench (JSON on stdout): what a stopped contender leaves behind."""
    import resource

    fields["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(fields), flush=True)


def worker(args) -> None:
    import contextlib

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    try:
        from ktransformers.operators.cpu_threads import set_cpu_infer_threads

        set_cpu_infer_threads(args.threads)
    except ImportError:
        pass
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    model, params = build(args.worker, Path(args.model), args.rank, args.gguf, dtype)
    _report(event="loaded", load_s=time.perf_counter() - t0, trainable=sum(p.numel() for p in params))
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        t = time.perf_counter()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
        with autocast:
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _report(event="step", step=i, warmup=i < args.warmup, step_s=time.perf_counter() - t, loss=float(loss))


# ------------------------------------------------------------------------------ the bench


@dataclass
class Result:
    """What one contender's process reported (complete, or up to its time limit)."""

    contender: str
    tokens_per_step: int
    total_steps: int
    events: list = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    in_progress_s: float = 0.0  # time spent in the step running when it was stopped

    @property
    def steady(self) -> list[float]:
        return sorted(e["step_s"] for e in self.events if e.get("event") == "step" and not e["warmup"])

    @property
    def tokens_per_s(self) -> float | None:
        """Median over the timed steps it completed (all of them, or those before its time limit)."""
        s = self.steady
        return self.tokens_per_step / s[len(s) // 2] if s else None

    @property
    def tokens_per_s_bound(self) -> float | None:
        """Stopped before any timed step: an upper bound (its step in progress took at least this long)."""
        if self.finished or self.error or self.steady or self.load_s is None or self.in_progress_s <= 0:
            return None  # (stopped while loading: no step to bound)
        return self.tokens_per_step / self.in_progress_s

    @property
    def peak_rss_mib(self) -> float | None:
        return max((e["peak_rss_mib"] for e in self.events), default=None)

    @property
    def load_s(self) -> float | None:
        return next((e["load_s"] for e in self.events if e.get("event") == "loaded"), None)


def run_worker(args, contender: str, path: Path) -> Result:
    """Run one contender in its own process for at most ``--time-limit`` seconds."""
    import threading

    cmd = [sys.executable, __file__, "--worker", contender, "--model", str(path), "--rank", str(args.rank),
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--dtype", args.dtype]
    if args.gguf and contender.startswith("kernels"):
        cmd += ["--gguf", args.gguf]
    res = Result(contender, args.batch * args.seq, args.warmup + args.steps)
    last = [time.perf_counter()]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)

        def read():
            for line in proc.stdout:
                if line.startswith("{"):
                    res.events.append(json.loads(line))
                    last[0] = time.perf_counter()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=args.time_limit)
        except subprocess.TimeoutExpired:
            res.in_progress_s = time.perf_counter() - last[0]
            proc.kill()
            proc.wait()
            reader.join(5)
            return res
        reader.join(5)
        if rc != 0:
            err.seek(0)
            res.error = (err.read().strip().splitlines() or [f"exit status {rc}"])[-1]
            return res
    res.finished = True
    return res


def print_row(r: Result, base: Result | None, limit: int) -> None:
    if r.error:
        print(f"{r.contender:<22} failed: {r.error}")
        return
    tps, bound, rss = r.tokens_per_s, r.tokens_per_s_bound, r.peak_rss_mib
    tps_s = f"{tps:.1f}" if tps else (f"<{bound:.1f}" if bound else "-")
    step_s = f"{r.tokens_per_step / tps:.2f}" if tps else (f">{r.in_progress_s:.0f}" if bound else "-")
    rss_s = "-" if rss is None else f"{'' if r.finished else '>='}{rss:.0f}"
    x_tps = x_rss = verdict = ""
    if base is not None and r is not base and tps:
        btps, brss = base.tokens_per_s or base.tokens_per_s_bound, base.peak_rss_mib
        if btps:
            x_tps = f"{'' if base.tokens_per_s else '>'}{tps / btps:.2f}"  # a bound when the baseline has one
        if rss is not None and brss:
            x_rss = f"{'' if r.finished and base.finished else '~'}{rss / brss:.2f}"
        if btps and brss and rss is not None:
            missed = [w for w, ok in (("tokens/s", tps >= 3 * btps), ("RSS", rss <= 0.5 * brss)) if not ok]
            verdict = "targets met" if not missed else "targets not met: " + ", ".join(missed)
    print(f"{r.contender:<22} {tps_s:>10} {step_s:>8} {rss_s:>13} {x_tps or '-':>11} {x_rss or '-':>7}  {verdict}",
          flush=True)
    if not r.finished:
        done = sum(e.get("event") == "step" for e in r.events)
        load = f"loaded in {r.load_s:.0f} s" if r.load_s is not None else "still loading"
        print(f"{'':<22} did not finish in {limit} s ({load}; {done} of {r.total_steps} steps done)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contenders", default="peft,torch,kernels:llamafile",
                   help="comma-separated: peft (baseline, first), torch, kernels:<backend>")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (the real model's: 151936)")
    p.add_argument("--tiny", action="store_true", help="the tiny model (smoke run)")
    p.add_argument("--gguf", help="quantized weights for the kernels contenders (same shape)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="torch-side weights (and the baseline's experts): bf16 under bf16 autocast, or fp32")
    p.add_argument("--time-limit", type=int, default=150, help="seconds per contender, its load included")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--make-model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.make_model:  # in its own process: keeps the bench's RSS small
        make_model(Path(args.make_model), args.tiny, args.layers, args.vocab)
        return 0
    if args.worker:
        worker(args)
        return 0
    path = model_dir(args)
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", flush=True)
        subprocess.run([sys.executable, __file__, "--make-model", str(path), "--layers", str(args.layers),
                        "--vocab", str(args.vocab)] + (["--tiny"] if args.tiny else []), check=True)
    print(f"model {path.name}; batch {args.batch} x {args.seq} tokens, LoRA r={args.rank} on "
          f"{'/'.join(ATTENTION)} + experts; {args.dtype} torch weights"
          f"{' under bf16 autocast' if args.dtype == 'bf16' else ', no autocast'}; {args.threads} threads; "
          f"median of {args.steps} steps after {args.warmup} warm-up; at most {args.time_limit} s per contender")
    base = None
    print(f"{'contender':<22} {'tokens/s':>10} {'step s':>8} {'peak RSS MiB':>13} {'x tokens/s':>11} {'x RSS':>7}"
          "  targets: >= 3x tokens/s, <= 0.5x RSS")
    for c in [s.strip() for s in args.contenders.split(",") if s.strip()]:
        r = run_worker(args, c, path)
        if c == "peft":
            r.contender = f"peft ({args.dtype} experts)"
            base = r
        print_row(r, base, args.time_limit)
    try:
        import kt_kernel  # noqa: F401

        print("kt-kernel is installed; its SFT MoE is not wired into this bench yet")
    except ImportError:
        print("kt-kernel: not installed (its SFT MoE row skipped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
