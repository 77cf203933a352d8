"""Speculative verify through the model's own forward (generation/verify_forward.py): Qwen3-Next
and Qwen3.5, whose DeltaNet layers the decode step does not serve.  Every verify row has the bits
of a plain one-token decode, ``undo`` leaves the cache (attention entries, conv windows, recurrent
states) as plain decoding of the kept rows leaves it, and greedy speculation is the plain answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ktransformers.generation import Generator, SamplingParams
from ktransformers.generation.verify_forward import forward_rows, forward_verifies

from .test_invariance import _NoText
from .test_speculative import _copy_prompt, check_speculative_greedy

ARCHS = [("qwen3_next", {"head_dim": 64}), ("qwen3_5_moe_text", {"head_dim": 64})]


def _flash_or_skip():
    from ktransformers.operators.cpu_attention import flash_mode

    if flash_mode() is None:
        pytest.skip("no prompt flash kernel on this tier (or KT_FLASH_ATTN=0): prompts are read with sdpa")


def _plain(g, prompt, toks, cap=40):
    """The logits of plain one-token decodes of ``toks`` after ``prompt``, and the cache after them."""
    cache = g.new_cache(cap)
    g.prefill(prompt, cache)
    n = len(prompt)
    rows = [g._forward(torch.tensor([[t]]), n + i, cache)[0].clone() for i, t in enumerate(toks)]
    return rows, cache


def _states(cache):
    """Every tensor the cache holds for the positions so far (attention entries up to the counter,
    conv windows, recurrent states)."""
    out = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            out += [layer.conv_states[0].clone(), layer.recurrent_states[0].clone()]
        else:
            m = int(layer.cumulative_length)
            out += [layer.keys[..., :m, :].clone(), layer.values[..., :m, :].clone(), torch.tensor(m)]
    return out


def _same_states(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: cache tensor {i} differs"


@pytest.mark.parametrize("arch,extra", ARCHS, ids=[a for a, _ in ARCHS])
def test_verify_rows_are_plain_decodes_and_undo_restores_the_cache(tiny, arch, extra):
    _flash_or_skip()
    model = tiny(arch, **extra)
    rng = np.random.default_rng(5)
    prompt = [int(i) for i in rng.integers(3, 250, 20)]
    toks = [int(i) for i in rng.integers(3, 250, 6)]
    g = Generator(model, _NoText())
    assert g._decode_step() is None and forward_verifies(model)
    n = len(prompt)
    with torch.inference_mode():
        want, _ = _plain(g, prompt, toks)
        for kept in (6, 3, 1):
            cache = g.new_cache(40)
            g.prefill(prompt, cache)
            logits, undo = forward_rows(model, toks, n, cache)
            for i in range(len(toks)):
                assert torch.equal(logits[i], want[i]), f"{arch}: verify row {i} differs from a plain decode"
            undo(kept)
            _, ref = _plain(g, prompt, toks[:kept])
            _same_states(_states(cache), _states(ref), f"{arch}: after undo({kept})")
            # decoding on from the undone cache gives the plain rows
            for i, t in enumerate(toks[kept:]):
                got = g._forward(torch.tensor([[t]]), n + kept + i, cache)[0]
                assert torch.equal(got, want[kept + i]), f"{arch}: decode {kept + i} after undo({kept})"


@pytest.mark.parametrize("arch,extra", ARCHS, ids=[a for a, _ in ARCHS])
def test_speculative_greedy_is_the_plain_answer(tiny, arch, extra, monkeypatch):
    _flash_or_skip()
    check_speculative_greedy(tiny(arch, **extra), SamplingParams(max_new_tokens=30), monkeypatch)


def test_without_the_fast_deltanet_forward_speculation_decodes_plainly(tiny, monkeypatch):
    """``KT_FAST_DELTANET=0`` runs transformers' DeltaNet forward, whose state this undo cannot
    replay: no guess is verified, the answer is the plain one."""
    _flash_or_skip()
    model = tiny("qwen3_next", head_dim=64)
    monkeypatch.setenv("KT_FAST_DELTANET", "0")
    assert not forward_verifies(model)
    prompt = _copy_prompt(np.random.default_rng(3))
    params = SamplingParams(max_new_tokens=12)
    _, want, _ = Generator(model, _NoText()).generate(prompt, params)
    g = Generator(model, _NoText(), speculative="ngram")
    _, got, _ = g.generate(prompt, params)
    assert got == want and g.last_stats.drafted_tokens == 0


def test_speculation_on_a_quantized_gguf(tmp_path, monkeypatch):
    """A Q8_0 GGUF of Qwen3-Next through the shipped rules: speculative greedy is the plain answer."""
    from ktransformers import load_model
    from ktransformers.convert import convert
    from ktransformers.util.tiny_models import write_tiny_model

    _flash_or_skip()
    d = tmp_path / "hf"
    write_tiny_model("qwen3_next", d, seed=2, head_dim=64)
    model = load_model(convert(d, tmp_path / "q8.gguf", "Q8_0", "Q8_0", "Q8_0"))
    check_speculative_greedy(model, SamplingParams(max_new_tokens=24), monkeypatch)
