"""LoRA training throughput and peak RSS: ours (training rules) vs transformers + PEFT.

    python bench/sft.py                                  # Qwen3-MoE layer dims, 2 layers, vocab 8192
    python bench/sft.py --layers 4 --contenders peft,torch,kernels:llamafile,kernels:AMXBF16
    python bench/sft.py --dtype fp32                     # fp32 torch weights, no autocast (every contender)
    python bench/sft.py --tiny --steps 3                 # smoke run on the tiny model (seconds)
    python bench/sft.py --moe-layer only                 # one routed-experts layer: ours vs kt-kernel
    python bench/sft.py --moe-layer only --experts 16 --seq 32 --layer-steps 2   # its smoke run

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

The MoE layer (``--moe-layer``: ``auto``, the default, after the model rows when kt-kernel is
found; ``only``; ``off``): kt-kernel's SFT MoE trains one routed-experts layer, not a model, so
the comparison is one Qwen3-MoE-shaped layer (hidden 2048, ``--experts`` experts (default 128), top-8,
intermediate 768), the same bf16 weights, routing, input and grad_output for every contender
(generated from one seed with torch alone, in each contender's own process), LoRA rank
``--rank`` (alpha 2r) on gate/up/down of every expert; per step the forward of ``--batch`` x
``--seq`` tokens and the backward to the input and the LoRA A/B factors:

* ``ours:<backend>``: ``ktransformers.kernels.MoETrainKernel`` on a ``MoEKernel`` of that backend
  (llamafile: bf16 weights in place; AMXBF16; AMXInt8: requantized at load);
* ``kt:<backend>``: kt-kernel's ``AMXBF16_SFT_MOE`` / ``AMXInt8_SFT_MOE`` / ``AMXInt4_SFT_MOE``
  (int8/int4 quantized from the bf16 weights at load), run by ``--kt-python`` (an interpreter
  with torch + kt_kernel; the worker imports nothing of ours).

Ours shares one LoRA A between gate and up (the fused ``gate_up_proj``, PEFT's layout);
kt-kernel has one per projection, here given the same values, so both compute the same function.
Printed: median fwd+bwd ms over ``--layer-steps`` after ``--layer-warmup``, tokens/s, peak RSS
of the contender's process, tokens/s relative to kt-kernel on the same weights (llamafile and
AMXBF16: kt:AMXBF16; AMXInt8: kt:AMXInt8), and, once per pair, whether the input and LoRA
gradients agree (max |ours - kt| / max |kt| within ``LAYER_DX_TOL``).
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
    from ktransformers.loading import load_model

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


# ------------------------------------------------------------------------------ one MoE layer: ours vs kt-kernel

LAYER_CONTENDERS = "kt:AMXBF16,kt:AMXInt8,kt:AMXInt4,ours:llamafile,ours:AMXBF16,ours:AMXInt8"
KT_CLASSES = {"AMXBF16": "AMXBF16_SFT_MOE", "AMXInt8": "AMXInt8_SFT_MOE", "AMXInt4": "AMXInt4_SFT_MOE"}
KT_SAME_WEIGHTS = {"llamafile": "AMXBF16", "AMXBF16": "AMXBF16", "AMXInt8": "AMXInt8"}  # ours -> kt backend
# input and LoRA gradients, max |ours - kt| / max |kt|, by kt backend: about each side's own error against a
# torch fp32 oracle added up (dx, bf16: kt 1.7e-2, ours <= 2.4e-3; int8: kt 3.0e-2, ours <= 1.6e-2), with
# room; measured between the two at 16 experts, 32 tokens: dx 2.1e-2 (bf16), 3.6e-2 (int8), LoRA grads
# <= 1.0e-2 (bf16), <= 1.8e-2 (int8)
LAYER_DX_TOL = {"AMXBF16": 3e-2, "AMXInt8": 6e-2}
KT_VENV_PYTHON = Path("/work/peers/venv-kt/bin/python")
LORA_SCALE = 2.0  # alpha = 2r, as in the model rows


def layer_problem(E: int, H: int, I: int, k: int, T: int, r: int, seed: int = 0) -> dict:
    """The layer's data from ``seed`` with torch alone (each interpreter regenerates it): bf16 weights
    gate/up [E, I, H], down [E, H, I]; x, grad_output [T, H] bf16; distinct expert ids per token [T, k]
    with routing weights summing to 1; LoRA A_gu [E, r, H], B_gu [E, 2I, r], A_d [E, r, I], B_d [E, H, r]
    (float32 holding bf16 values, so that both sides see the same numbers)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def bf16(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).bfloat16()

    P = {n: torch.empty(E, *shape, dtype=torch.bfloat16) for n, shape in
         (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
    for e in range(E):  # one expert at a time: no fp32 copy of the layer
        for n in ("gate", "up", "down"):
            P[n][e] = bf16(*P[n].shape[1:], std=0.02)
    P["x"] = bf16(T, H)
    P["ids"] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    P["w"] = w / w.sum(1, keepdim=True)
    for n, shape in (("A_gu", (E, r, H)), ("B_gu", (E, 2 * I, r)), ("A_d", (E, r, I)), ("B_d", (E, H, r))):
        P[n] = bf16(*shape, std=0.02).float()
    P["dout"] = bf16(T, H)
    return P


def _fingerprint(P: dict) -> list:
    """Sums that differ if two interpreters' torch generated different data."""
    return [round(float(P[n].double().sum()), 6) for n in ("x", "w", "dout", "A_gu", "B_d")] + \
        [round(float(P["down"][-1].double().sum()), 6), int(P["ids"].sum())]


def _ours_layer(P: dict, backend: str, threads: int):
    """One fwd+bwd step of MoETrainKernel on a MoEKernel of ``backend``."""
    from ktransformers import kernels as K

    E, I, H = P["gate"].shape
    moe = K.MoEKernel(K.cpu_infer(threads), backend, E, H, I, P["gate"], P["up"], P["down"], "BF16", "BF16", "BF16")
    tk = K.MoETrainKernel(moe)
    gu, dn = K.LoraFactors(P["A_gu"], P["B_gu"], LORA_SCALE), K.LoraFactors(P["A_d"], P["B_d"], LORA_SCALE)
    x, ids, w, dout = P["x"].float(), P["ids"], P["w"], P["dout"].float()

    def step():
        t0 = time.perf_counter()
        _, saved = tk.forward(x, ids, w, gu, dn)
        t1 = time.perf_counter()
        dx, _, dA_gu, dB_gu, dA_d, dB_d = tk.backward(x, ids, w, dout, saved, gu, dn)
        grads = {"dx": dx, "A_gu": dA_gu, "B_gu": dB_gu, "A_d": dA_d, "B_d": dB_d}
        return grads, t1 - t0, time.perf_counter() - t1

    return step


def _kt_layer(P: dict, backend: str, threads: int):
    """One fwd+bwd step of kt-kernel's SFT MoE (``KT_CLASSES[backend]``) through its extension classes."""
    import torch
    from kt_kernel import kt_kernel_ext as ext

    E, I, H = P["gate"].shape
    T, k = P["ids"].shape
    r = P["A_gu"].shape[1]
    cpu = ext.CPUInfer(threads)
    keep = {"gate_proj": P["gate"], "up_proj": P["up"], "down_proj": P["down"],
            "gate_lora_a": P["A_gu"].bfloat16(), "up_lora_a": P["A_gu"].bfloat16(),  # one A for both, as ours
            "gate_lora_b": P["B_gu"][:, :I].bfloat16().contiguous(), "up_lora_b": P["B_gu"][:, I:].bfloat16().contiguous(),
            "down_lora_a": P["A_d"].bfloat16(), "down_lora_b": P["B_d"].bfloat16(),
            "physical_to_logical_map": torch.arange(E, dtype=torch.int64)}
    cfg = ext.moe.MOESFTConfig()
    cfg.expert_num, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size = E, k, H, I
    cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout = r, LORA_SCALE * r, 0.0
    cfg.max_cache_depth, cfg.max_len, cfg.layer_idx = 1, (T + 31) // 32 * 32, 0
    for name, t in keep.items():
        setattr(cfg, name, t.data_ptr())
    cfg.pool = cpu.backend_
    moe = getattr(ext.moe, KT_CLASSES[backend])(cfg)
    cpu.submit(moe.load_weights_task())
    cpu.sync()
    for n in ("gate_proj", "up_proj", "down_proj"):  # copied at load (kt-kernel's own wrapper drops them too)
        del keep[n]
    bsz = torch.tensor([T], dtype=torch.int32)
    x, ids, w, dout = P["x"].contiguous(), P["ids"].to(torch.int64).contiguous(), P["w"].contiguous(), P["dout"]
    out, dx = torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)
    dw = torch.empty(T, k, dtype=torch.float32)
    grads = [torch.empty_like(keep[f"{p}_lora_{ab}"]) for p in ("gate", "up", "down") for ab in ("a", "b")]

    def step():
        for g in grads:
            g.zero_()
        t0 = time.perf_counter()
        cpu.submit(moe.forward_sft_task(bsz.data_ptr(), k, ids.data_ptr(), w.data_ptr(), x.data_ptr(),
                                        out.data_ptr(), True))
        cpu.sync()
        t1 = time.perf_counter()
        cpu.submit(moe.backward_task(dout.data_ptr(), dx.data_ptr(), *(g.data_ptr() for g in grads), dw.data_ptr(),
                                     0, 0, 0))
        cpu.sync()
        t2 = time.perf_counter()
        ga, gb, ua, ub, da, db = grads  # in ours' layout: the shared A's grad is the sum of both
        return {"dx": dx, "A_gu": ga.float() + ua.float(), "B_gu": torch.cat([gb, ub], 1), "A_d": da, "B_d": db}, \
            t1 - t0, t2 - t1

    step.keep = (cpu, moe, keep, bsz, x, ids, w, dout, out, dx, dw, grads)
    return step


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def layer_worker(args) -> None:
    """``--layer-worker ours:<backend>|kt:<backend>``; a kt side runs under --kt-python and imports
    only torch + kt_kernel."""
    side, _, backend = args.layer_worker.partition(":")
    if side == "kt":  # its interpreter need not have our package: keep it off the path
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    P = layer_problem(args.experts, QWEN3_DIMS["hidden_size"], QWEN3_DIMS["moe_intermediate_size"],
                      QWEN3_DIMS["num_experts_per_tok"], args.batch * args.seq, args.rank)
    gen_s = time.perf_counter() - t0
    step = (_ours_layer if side == "ours" else _kt_layer)(P, backend, args.threads)
    if side == "ours":
        from ktransformers.kernels import isa_tier

        isa = f"ISA tier {isa_tier()}"
    else:
        import kt_kernel

        isa = f"variant {kt_kernel.__cpu_variant__}"
    fp = _fingerprint(P)
    P.clear()  # the kernels hold what they need (llamafile: the bf16 weights, in place)
    _report(event="loaded", load_s=time.perf_counter() - t0, gen_s=gen_s, data=fp, torch=torch.__version__, isa=isa)
    for i in range(args.layer_warmup + args.layer_steps):
        c0 = time.process_time()
        grads, fwd_s, bwd_s = step()
        _report(event="step", step=i, warmup=i < args.layer_warmup, step_s=fwd_s + bwd_s, fwd_s=fwd_s, bwd_s=bwd_s,
                cpu_s=time.process_time() - c0, rss_mib=_rss_mib())
    if args.dx_out:
        torch.save({n: g.float().clone() for n, g in grads.items()}, args.dx_out)


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
    cmd = [sys.executable, __file__, "--worker", contender, "--model", str(path), "--rank", str(args.rank),
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--dtype", args.dtype]
    if args.gguf and contender.startswith("kernels"):
        cmd += ["--gguf", args.gguf]
    return run_process(cmd, Result(contender, args.batch * args.seq, args.warmup + args.steps), args.time_limit)


def run_process(cmd: list[str], res: Result, time_limit: int, env: dict | None = None) -> Result:
    """Collect the JSON progress lines of ``cmd`` into ``res``; kill it after ``time_limit`` s."""
    import threading

    last = [time.perf_counter()]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)

        def read():
            for line in proc.stdout:
                if line.startswith("{"):
                    try:
                        res.events.append(json.loads(line))
                    except json.JSONDecodeError:  # a native library's print interleaved with ours
                        continue
                    last[0] = time.perf_counter()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=time_limit)
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


def find_kt_python(arg: str | None) -> tuple[str | None, str]:
    """(interpreter that imports kt_kernel, 'version variant') or (None, why not)."""
    cands = [arg] if arg else ([str(KT_VENV_PYTHON)] if KT_VENV_PYTHON.exists() else []) + [sys.executable]
    why = "kt_kernel not importable"
    for py in cands:
        try:
            r = subprocess.run([py, "-c", "import kt_kernel as k; print('KT', k.__version__, k.__cpu_variant__)"],
                               capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"{py}: {e}"
            continue
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("KT ")), None)
        if r.returncode == 0 and line:
            return py, line[3:]
        why = f"{py}: " + ((r.stderr.strip().splitlines() or ["kt_kernel not importable"])[-1])
    return None, why


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def run_layer(args, contender: str, kt_python: str | None, dx_dir: Path) -> Result:
    side, _, backend = contender.partition(":")
    py = sys.executable if side == "ours" else kt_python
    cmd = [py, __file__, "--layer-worker", contender, "--experts", str(args.experts), "--rank", str(args.rank),
           "--batch", str(args.batch), "--seq", str(args.seq), "--layer-steps", str(args.layer_steps),
           "--layer-warmup", str(args.layer_warmup), "--threads", str(args.threads),
           "--dx-out", str(dx_dir / f"{side}-{backend}.pt")]
    env = None
    if side == "kt":  # the kt interpreter's own packages, not ours
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return run_process(cmd, Result(contender, args.batch * args.seq, args.layer_warmup + args.layer_steps),
                       args.time_limit, env)


def print_layer_row(r: Result, kt: Result | None, limit: int) -> None:
    if r.error:
        print(f"{r.contender:<16} failed: {r.error}", flush=True)
        return
    steps = [e for e in r.events if e.get("event") == "step" and not e["warmup"]]
    ms = {f: _median([e[f] for e in steps]) for f in ("step_s", "fwd_s", "bwd_s")}
    cores = _median([e["cpu_s"] / e["step_s"] for e in steps if e["step_s"] > 0])
    tps, rss = r.tokens_per_s, r.peak_rss_mib
    fmt = lambda v: "-" if v is None else f"{1e3 * v:.1f}"  # noqa: E731
    ratio = "-"
    if kt is not None and tps and kt.tokens_per_s:
        ratio = f"{tps / kt.tokens_per_s:.2f} ({kt.contender})"
    rss_s = "-" if rss is None else f"{'' if r.finished else '>='}{rss:.0f}"
    now = f"{steps[-1]['rss_mib']:.0f}" if steps else "-"
    print(f"{r.contender:<16} {fmt(ms['step_s']):>11} {fmt(ms['fwd_s']):>8} {fmt(ms['bwd_s']):>8} "
          f"{'-' if cores is None else f'{cores:.2f}':>5} "
          f"{f'{tps:.1f}' if tps else '-':>10} {rss_s:>13} {now:>8} {'-' if r.load_s is None else f'{r.load_s:.0f}':>6}"
          f"  {ratio}", flush=True)
    if not r.finished:
        done = sum(e.get("event") == "step" for e in r.events)
        load = f"loaded in {r.load_s:.0f} s" if r.load_s is not None else "still loading"
        print(f"{'':<16} did not finish in {limit} s ({load}; {done} of {r.total_steps} steps done)")


def check_dx(ours: Result, kt: Result, dx_dir: Path) -> None:
    """Input and LoRA gradients of ours against kt-kernel's on the same data (the last step's), within
    LAYER_DX_TOL."""
    import torch

    backend = kt.contender.partition(":")[2]
    fa, fb = (dx_dir / f"{c.contender.replace(':', '-')}.pt" for c in (ours, kt))
    head = f"grads {ours.contender} vs {kt.contender}:"
    if not (ours.finished and kt.finished and fa.exists() and fb.exists()):
        print(f"{head} not checked (a side did not finish)")
        return
    da, db = (next(e for e in c.events if e.get("event") == "loaded") for c in (ours, kt))
    if da["data"] != db["data"]:
        print(f"{head} not checked: the two interpreters' torch ({da['torch']} / {db['torch']}) generated "
              f"different data from the seed")
        return
    a, b = torch.load(fa), torch.load(fb)
    errs = {n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b}
    tol = LAYER_DX_TOL[backend]
    bad = [n for n, e in errs.items() if e > tol]
    print(f"{head} max|ours - kt| / max|kt|: " + ", ".join(f"{'' if n == 'dx' else 'd'}{n} {e:.2e}" for n, e in errs.items())
          + f" (tolerance {tol:.0e}): " + ("agree" if not bad else "DISAGREE on " + ", ".join(bad)))


def layer_bench(args, kt_python: str | None, kt_info: str) -> None:
    T = args.batch * args.seq
    contenders = [c.strip() for c in args.layer_contenders.split(",") if c.strip()]
    names = [f"ours:{b}" for b in KT_SAME_WEIGHTS] + [f"kt:{b}" for b in KT_CLASSES]
    for c in contenders:
        if c not in names:
            raise SystemExit(f"--layer-contenders: unknown {c!r} (expected one of {', '.join(names)})")
    if kt_python is None:
        print(f"kt-kernel: not installed ({kt_info}); its rows skipped")
        contenders = [c for c in contenders if not c.startswith("kt:")]
    contenders.sort(key=lambda c: not c.startswith("kt:"))  # kt first: the ratios need them
    print(f"\nMoE layer: hidden {QWEN3_DIMS['hidden_size']}, {args.experts} experts, top-"
          f"{QWEN3_DIMS['num_experts_per_tok']}, intermediate {QWEN3_DIMS['moe_intermediate_size']}; {T} tokens; "
          f"bf16 weights; LoRA r={args.rank} on gate/up/down; forward + backward (input, LoRA A/B grads); "
          f"{args.threads} threads; median of {args.layer_steps} steps after {args.layer_warmup} warm-up; "
          f"at most {args.time_limit} s per contender" + (f"; kt-kernel {kt_info} ({kt_python})" if kt_python else ""))
    print(f"{'contender':<16} {'fwd+bwd ms':>11} {'fwd ms':>8} {'bwd ms':>8} {'cores':>5} {'tokens/s':>10} {'peak RSS MiB':>13} "
          f"{'RSS MiB':>8} {'load s':>6}  x tokens/s vs kt-kernel, same weights", flush=True)
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory() as d:
        for c in contenders:
            r = results[c] = run_layer(args, c, kt_python, Path(d))
            side, _, backend = c.partition(":")
            print_layer_row(r, results.get(f"kt:{KT_SAME_WEIGHTS[backend]}") if side == "ours" else None,
                            args.time_limit)
        isa = {c.partition(":")[0]: e["isa"] for c, r in results.items() for e in r.events if e.get("event") == "loaded"}
        if isa:
            print("kernels: " + "; ".join(f"{'ours' if s == 'ours' else 'kt-kernel'} {v}" for s, v in sorted(isa.items(),
                  reverse=True)) + " (KT_ISA picks ours, KT_KERNEL_CPU_VARIANT kt-kernel's)")
        for c, r in results.items():
            side, _, backend = c.partition(":")
            kt = results.get(f"kt:{KT_SAME_WEIGHTS[backend]}") if side == "ours" else None
            if kt is not None:
                check_dx(r, kt, Path(d))


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
    p.add_argument("--moe-layer", choices=("auto", "only", "off"), default="auto",
                   help="the one-layer comparison with kt-kernel's SFT MoE: after the model rows when kt-kernel "
                        "is found (auto), alone (only), or not (off)")
    p.add_argument("--layer-contenders", default=LAYER_CONTENDERS,
                   help="comma-separated: ours:<llamafile|AMXBF16|AMXInt8>, kt:<AMXBF16|AMXInt8|AMXInt4>")
    p.add_argument("--experts", type=int, default=QWEN3_DIMS["num_experts"], help="experts of the MoE layer")
    p.add_argument("--layer-steps", type=int, default=5, help="timed MoE-layer steps (the median is reported)")
    p.add_argument("--layer-warmup", type=int, default=1, help="untimed MoE-layer steps first")
    p.add_argument("--kt-python", help="interpreter with torch + kt_kernel (default: "
                                       f"{KT_VENV_PYTHON} if it exists, else this one if it imports kt_kernel)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--layer-worker", help=argparse.SUPPRESS)
    p.add_argument("--dx-out", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--make-model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.make_model:  # in its own process: keeps the bench's RSS small
        make_model(Path(args.make_model), args.tiny, args.layers, args.vocab)
        return 0
    if args.worker:
        worker(args)
        return 0
    if args.layer_worker:
        layer_worker(args)
        return 0
    if args.moe_layer == "only":
        layer_bench(args, *find_kt_python(args.kt_python))
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
    if args.moe_layer == "auto":
        kt_python, kt_info = find_kt_python(args.kt_python)
        if kt_python is None:
            print(f"kt-kernel: not installed ({kt_info}); its SFT MoE layer rows skipped")
        else:
            layer_bench(args, kt_python, kt_info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
