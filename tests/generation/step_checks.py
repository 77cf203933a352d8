"""Checks shared by the decode step's tests (test_decode_step_mla.py, test_decode_step_glm.py,
test_lean_decode.py)."""

from __future__ import annotations

from pathlib import Path

import torch

import ktransformers
from ktransformers.generation import Generator, SamplingParams
from ktransformers.generation.decode_step import decode_step_for
from ktransformers.util.tiny_models import write_tiny_model

from .test_invariance import _NoText

_PAIRS: dict[Path, tuple] = {}


def tiny_pair(folder: Path, arch: str, rules: Path, **overrides):
    """(unmodified transformers model, injected model) of a tiny random ``arch`` (seed 3) written to
    ``folder`` and loaded through ``rules``, built once per folder."""
    if folder not in _PAIRS:
        hf = write_tiny_model(arch, folder, seed=3, **overrides)
        _PAIRS[folder] = (hf, ktransformers.load_model(folder, model_path=folder, rules=rules))
    return _PAIRS[folder]


def prompt(n=12, seed=0):
    return [int(i) for i in torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))]


def prefilled_cache(step, g, ids, room: int):
    """A new cache of Generator ``g`` with ``room`` positions after ``ids``, prefilled: the step
    refuses it before the prefill (its layers not initialised) and takes it after.  Call in
    inference mode."""
    cache = g.new_cache(len(ids) + room)
    assert not step.accepts(cache)  # layers not initialised before the prefill
    g.prefill(ids, cache)
    assert step.accepts(cache)
    return cache


def own_forward(model, tok, pos, cache):
    """The model's own forward (not the step answering under it, generation/hf_generate.py)."""
    own = model.__dict__.get("_kt_lean_forward") or model
    return own(input_ids=torch.tensor([[tok]]), cache=cache, position_ids=torch.tensor([[pos]]),
               use_cache=True, logits_to_keep=1).logits[0, -1].float()


def check_greedy_against_transformers(hf, model, case: str, steps: int = 16) -> None:
    """The step's greedy decode of a prompt: every step's logits within 1e-4 x max|logits| of the
    unmodified model teacher-forced on the step's tokens, the Generator's tokens the same, and the
    tokens equal transformers' own greedy ones wherever its top-1 margin exceeds that bar."""
    g = Generator(model, _NoText())
    g.eos_ids = set()
    ids = prompt(8, seed=1)
    step = decode_step_for(model)
    rows = []
    with torch.inference_mode():
        cache = g.new_cache(len(ids) + steps + 1)
        logits = g.prefill(ids, cache)[0]
        toks = []
        for i in range(steps):
            toks.append(int(logits.argmax()))
            assert step.accepts(cache)
            logits = step.step(toks[-1], len(ids) + i, cache)[0]
            rows.append(logits.clone())
    _, got, _ = g.generate(ids, SamplingParams(max_new_tokens=steps))
    assert got == toks  # the Generator decodes through the same step
    seq = torch.tensor([ids + toks])
    with torch.no_grad():
        ref = hf(seq).logits[0].float()
    tol = 1e-4 * ref.abs().max().item()
    for i, row in enumerate(rows):  # teacher-forced on the step's tokens: every step's logits
        diff = (row - ref[len(ids) + i]).abs().max().item()
        assert diff <= tol, f"{case}: step {i} off transformers by {diff:.3g} (tolerance {tol:.3g})"
    want = hf.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       pad_token_id=0)[0, len(ids):].tolist()
    top2 = ref[len(ids) - 1:-1].topk(2, dim=-1).values
    for i in range(steps):
        if top2[i, 0] - top2[i, 1] <= tol:
            break  # a near tie: the continuations may part from here on
        assert got[i] == want[i], f"{case}: greedy token {i} is {got[i]}, transformers gives {want[i]}"
    assert i >= steps // 2, f"{case}: only {i} clear steps; the check would be vacuous"


def step_against_own_forward(model, kind: str, steps: int = 20):
    """Decode ``steps`` tokens after a prompt twice, on two ``kind`` ("static" / "dynamic") caches:
    one with the model's own forward, one with the step, fed the forward's greedy tokens.  Returns
    (the largest gap between their logits / max|logits|, the forward's cache, the step's cache,
    the positions written)."""
    from transformers import DynamicCache

    step = decode_step_for(model)
    g = Generator(model, _NoText())
    ids = prompt()
    worst = 0.0

    def cache():
        return g.new_cache(48) if kind == "static" else DynamicCache(config=model.config)

    with torch.inference_mode():
        ca, cb = cache(), cache()
        tok = int(g.prefill(ids, ca).argmax())
        g.prefill(ids, cb)
        for pos in range(len(ids), len(ids) + steps):
            want = own_forward(model, tok, pos, ca)
            assert step.accepts(cb)
            got = step.step(tok, pos, cb)[0]
            worst = max(worst, (got - want).abs().max().item() / want.abs().max().item())
            tok = int(want.argmax())
    return worst, ca, cb, len(ids) + steps
