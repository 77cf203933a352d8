"""The lean single-token decode step (generation/decode_step.py) against the generic forward and HF.

Tolerances:
* tiny fp32 models (F32 weights on the CPU kernels, no activation quantisation): the lean step's
  logits are within 1e-5 x max|logits| of the generic forward on the same cache state, every
  step (measured: 3.0e-7 .. 4.9e-7 over the six families), sliding-window layers past their
  window included;
* greedy continuations equal the unmodified transformers model's wherever its top-1 margin
  exceeds 1e-4 x max|logits| (teacher-forced on HF's own continuation);
* Gemma-3-270M Q4_K_M (when the bench file is present): activations are quantised to int8 before
  every matrix, so a last-bit difference in an input can move a logit by more than 1 (the
  generic forward's own ``sdpa`` and ``eager`` attention differ by 1-6 on 10 steps); the lean
  step is held to twice that spread, measured in the test, and to the generic forward's argmax
  wherever its margin exceeds that tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ktransformers import load_model
from ktransformers.generation import Generator, SamplingParams
from ktransformers.generation.decode_step import DecodeStep, decode_step_for

from .step_checks import own_forward, prefilled_cache
from .test_invariance import _NoText

LEAN_ARCHS = ["llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "qwen2_moe"]
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")
GEMMA = Path(__file__).resolve().parents[2] / ".cache" / "models" / "gemma-3-270m-q4_k_m.gguf"


def _prompt(n=12, seed=0):
    return [int(i) for i in torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_lean_step_equals_generic_forward(arch, tiny_model_dir, one_torch_thread):
    d = tiny_model_dir(arch)
    model = load_model(d, model_path=d)
    step = DecodeStep.build(model)
    assert step is not None, f"{arch}: the lean decode step should serve this family"
    if arch in MOE_ARCHS:  # the MoE blocks run in the step (router, experts, shared expert), not as modules
        assert all(lay.moe is not None and lay.mlp_module is None for lay in step.layers)
        assert (arch == "qwen2_moe") == (step.layers[0].moe.shared is not None)
    gen = Generator(model, _NoText())
    ids = _prompt()
    worst = 0.0
    with torch.inference_mode():
        ca, cb = gen.new_cache(40), gen.new_cache(40)
        ref = gen.prefill(ids, ca)
        gen.prefill(ids, cb)
        tok = int(ref.argmax())
        for pos in range(len(ids), len(ids) + 20):  # gemma3's tiny window is 8: the roll branch runs
            want = own_forward(model, tok, pos, ca)
            assert step.accepts(cb)
            got = step.step(tok, pos, cb)[0]
            worst = max(worst, (got - want).abs().max().item() / want.abs().max().item())
            tok = int(want.argmax())
        for la, lb in zip(ca.layers, cb.layers):  # the cache is left as the layer's own update leaves it
            assert la.get_seq_length() == lb.get_seq_length()
            assert int(la.cumulative_length) == int(lb.cumulative_length)
            assert torch.allclose(la.keys, lb.keys, rtol=1e-5, atol=1e-5 * la.keys.abs().max().item())
    assert worst <= 1e-5, f"{arch}: lean step off the generic forward by {worst:.2e} x max|logits|"


@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_lean_greedy_matches_hf_where_clear(arch, tiny_model_dir, one_torch_thread):
    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(d, model_path=d)
    gen = Generator(model, _NoText())
    gen.eos_ids = set()
    ids = _prompt(6, seed=1)
    steps = 16
    _, got, _ = gen.generate(ids, SamplingParams(max_new_tokens=steps))
    assert gen._decode_step() is not None
    x = torch.tensor([ids])
    seq = hf.generate(x, max_new_tokens=steps, do_sample=False, min_new_tokens=steps, pad_token_id=0)
    with torch.no_grad():
        ref = hf(seq).logits[0, len(ids) - 1:-1]
    tol = 1e-4 * ref.abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    want = seq[0, len(ids):].tolist()
    for i in range(steps):
        if top2[i, 0] - top2[i, 1] <= tol:
            break  # a near tie: the continuations may part from here on
        assert got[i] == want[i], f"{arch}: greedy token {i} is {got[i]}, transformers gives {want[i]}"
    assert i >= steps // 2, f"{arch}: only {i} clear steps; the check would be vacuous"


def test_gate_falls_back_to_the_generic_forward(tiny_model_dir, monkeypatch, one_torch_thread):
    d = tiny_model_dir("llama")
    model = load_model(d, model_path=d)
    step = decode_step_for(model)
    assert step is not None and decode_step_for(model) is step  # built once per model
    gen = Generator(model, _NoText())
    ids = _prompt()
    with torch.inference_mode():
        cache = prefilled_cache(step, gen, ids, 4)
        dyn = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids]), cache=dyn, use_cache=True)
        assert step.accepts(dyn)  # served too (tests/generation/test_hf_generate.py)

        class OwnCache(DynamicCache):  # a subclass may keep its entries elsewhere: not served
            pass

        own = OwnCache(config=model.config)
        model(input_ids=torch.tensor([ids]), cache=own, use_cache=True)
        assert not step.accepts(own)
    assert not step.accepts(cache)  # outside inference mode (autograd may be recording)
    called = []
    monkeypatch.setattr(DecodeStep, "step", lambda self, *a: called.append(a) or None)
    with torch.inference_mode():
        gen._forward(torch.tensor([ids[:2]]), len(ids), cache)  # two tokens: the generic forward
        assert not called
    monkeypatch.setenv("KT_LEAN_DECODE", "0")
    gen2 = Generator(model, _NoText())
    assert gen2._decode_step() is None


def test_unsupported_family_has_no_lean_step(tiny_model_dir):
    d = tiny_model_dir("mixtral")
    assert DecodeStep.build(load_model(d, model_path=d)) is None


@pytest.mark.skipif(not GEMMA.is_file(), reason=f"{GEMMA} not present (bench/e2e.py assembles it)")
def test_gemma3_q4km_within_the_generic_paths_own_spread(monkeypatch):
    # fp32 P V: the step's own structure against the generic path (the default bf16 P V, on tiers
    # with AVX512-BF16, moves these logits by up to ~2 and is the kernels' precision, bounded in
    # tests/kernels/test_attention.py; its decode = prompt bits in tests/generation/test_invariance.py)
    monkeypatch.setenv("KT_FLASH_ATTN", "fp32")
    model = load_model(GEMMA)
    cfg = model.config.get_text_config()
    step = DecodeStep.build(model)
    assert step is not None
    gen = Generator(model, _NoText())
    ids = list(range(1000, 1016))
    rows = []
    with torch.inference_mode():
        caches = {k: gen.new_cache(40) for k in ("sdpa", "eager", "lean")}
        for c in caches.values():
            gen.prefill(ids, c)
        tok = 2000
        try:
            for pos in range(len(ids), len(ids) + 10):
                out = {}
                for impl in ("sdpa", "eager"):
                    model.config._attn_implementation = cfg._attn_implementation = impl
                    out[impl] = own_forward(model, tok, pos, caches[impl]).clone()
                out["lean"] = step.step(tok, pos, caches["lean"])[0].clone()
                rows.append(out)
                tok = int(out["sdpa"].argmax())
        finally:
            model.config._attn_implementation = cfg._attn_implementation = "sdpa"
    spread = max((r["sdpa"] - r["eager"]).abs().max().item() for r in rows)
    lean = max((r["sdpa"] - r["lean"]).abs().max().item() for r in rows)
    tol = 2 * max(spread, 1e-3)
    assert lean <= tol, f"lean step off by {lean:.3f}, the generic path's own spread is {spread:.3f}"
    for i, r in enumerate(rows):
        top2 = r["sdpa"].topk(2).values
        if top2[0] - top2[1] > tol:
            assert int(r["lean"].argmax()) == int(r["sdpa"].argmax()), f"step {i}: a clear top-1 differs"


@pytest.mark.parametrize("E,k,norm", [(128, 8, True), (128, 8, False), (60, 4, True), (8, 8, True), (16, 1, False)])
def test_moe_route_matches_the_transformers_router(E, k, norm):
    """decode_ops.moe_route against Qwen3MoeTopKRouter's softmax -> topk -> renormalise (torch):
    same expert ids in the same order (random logits, no ties), weights within 2e-6 relative."""
    from ktransformers import cpuinfer_ext

    g = torch.Generator().manual_seed(E * 10 + k)
    for _ in range(20):
        logits = (3 * torch.randn(E, generator=g)).contiguous()
        probs = torch.softmax(logits[None], dim=-1, dtype=torch.float)
        want_w, want_ids = torch.topk(probs, k, dim=-1)
        if norm:
            want_w = want_w / want_w.sum(dim=-1, keepdim=True)
        ids = torch.full((1, k), -1, dtype=torch.int64)
        w = torch.zeros(1, k)
        cpuinfer_ext.decode_ops.moe_route(logits.data_ptr(), E, k, norm, ids.data_ptr(), w.data_ptr())
        assert ids.tolist() == want_ids.tolist()
        assert torch.allclose(w, want_w, rtol=2e-6, atol=0)


def test_moe_route_rejects_bad_arguments():
    from ktransformers import cpuinfer_ext

    logits, ids, w = torch.zeros(8), torch.zeros(1, 9, dtype=torch.int64), torch.zeros(1, 9)
    with pytest.raises(ValueError, match="0 < k <= E"):
        cpuinfer_ext.decode_ops.moe_route(logits.data_ptr(), 8, 9, True, ids.data_ptr(), w.data_ptr())
    logits[:] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        cpuinfer_ext.decode_ops.moe_route(logits.data_ptr(), 8, 2, True, ids.data_ptr(), w.data_ptr())


QWEN3MOE_Q4KM = GEMMA.parent / "bench-qwen3moe-4l-h2048-e128-v32768-llama-Q4_K_M.gguf"


@pytest.mark.parametrize("path", [GEMMA, QWEN3MOE_Q4KM], ids=["gemma3-Q8_0-scaled", "qwen3moe-Q4_K"])
def test_lean_embedding_row_equals_the_module(path):
    """The step's C++ dequantize of one embedding row (times Gemma's embed_scale) against the
    embedding module's torch block dequantizer: equal within 1e-6 x max|row| (measured: 0)."""
    if not path.is_file():
        pytest.skip(f"{path} not present (bench/e2e.py builds it)")
    model = load_model(path)
    step = DecodeStep.build(model)
    assert step is not None and step.embed_rows is not None
    vocab = step.embed_rows[0].shape[0]
    with torch.inference_mode():
        for tok in (0, 1, 777, vocab - 1):
            want = model.model.embed_tokens(torch.tensor([[tok]])).reshape(-1).float()
            got = step.embed_into_x(tok)
            assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max().item()), f"token {tok}"
