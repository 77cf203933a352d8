"""transformers' assisted decoding on an injected model: ``generate(prompt_lookup_num_tokens=k)`` and
``generate(assistant_model=...)`` give plain greedy ``generate()``'s tokens and logits, bit for bit.

The verify forwards are answered by ``DecodeStep.step_rows`` (generation/hf_generate.py), whose row
r has the bits of the plain step after the rows before it; the first forward (prompt and guesses
on an empty cache) is split into the prompt as plain ``generate()`` reads it and the guesses as
verify rows; transformers' ``cache.crop`` of the rejected rows is the step's undo.  Checked per
family the step serves, on a static and a dynamic cache, with transformers' own prompt lookup, an
oracle candidate generator (guesses right and wrong at every depth), a twin assistant (every guess
kept) and a different assistant.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from ktransformers.generation.decode_step import DecodeStep, decode_step_for

H64 = {"head_dim": 64}
FAMILIES = [("llama", H64), ("qwen3_moe", H64), ("deepseek_v2", {}), ("deepseek_v3", {}), ("glm4_moe", H64)]
CACHES = [None, "static"]


@pytest.fixture
def rows_spy(monkeypatch):
    """Counts the verify steps (``step_rows`` calls that answered) and their rows."""
    calls = []
    real = DecodeStep.step_rows

    def step_rows(self, tokens, pos, cache):
        out = real(self, tokens, pos, cache)
        if out is not None:
            calls.append(len(tokens))
        return out

    monkeypatch.setattr(DecodeStep, "step_rows", step_rows)
    return calls


def _prompt(seed=3, n=12, repeats=3):
    run = [int(i) for i in np.random.default_rng(seed).integers(3, 250, n)]
    return run * repeats + run[: n // 2]


def _generate(model, ids, n, cache_implementation, **kw):
    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=n,
                           output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=cfg, cache_implementation=cache_implementation,
                             **kw)
    return out.sequences[0, len(ids):].tolist(), torch.stack([g[0] for g in out.logits])


def _same(arch, got, want):
    (gt, gl), (wt, wl) = got, want
    assert gt == wt, f"{arch}: assisted greedy tokens differ from plain greedy generate()"
    assert gl.shape == wl.shape and torch.equal(gl, wl), f"{arch}: assisted logits differ from plain ones"


@pytest.mark.parametrize("cache_implementation", CACHES, ids=["dynamic", "static"])
@pytest.mark.parametrize("arch,extra", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_prompt_lookup_is_plain_greedy_bit_for_bit(tiny, arch, extra, cache_implementation, rows_spy,
                                                   one_torch_thread):
    model = tiny(arch, **extra)
    assert decode_step_for(model) is not None
    ids, n = _prompt(), 24
    want = _generate(model, ids, n, cache_implementation)
    assert not rows_spy
    got = _generate(model, ids, n, cache_implementation, prompt_lookup_num_tokens=3)
    _same(arch, got, want)
    assert rows_spy and max(rows_spy) > 1, f"{arch}: no verify ran on the step"


class _Oracle:
    """Candidates from the known plain answer, every third one wrong."""

    def __init__(self, prompt_len, answer, k=4):
        self.n, self.answer, self.k = prompt_len, answer, k

    def __call__(self, generator, input_ids):
        at = input_ids.shape[1] - self.n
        room = len(self.answer) - at - 1
        out = list(self.answer[at:at + min(self.k, max(room, 0))])
        for i in range(len(out)):
            if (at + i) % 3 == 2:
                out[i] = (out[i] + 1) % 250 + 3
        if not out:
            return input_ids, None
        return torch.cat([input_ids, torch.tensor([out], dtype=input_ids.dtype)], dim=1), None


@pytest.mark.parametrize("cache_implementation", CACHES, ids=["dynamic", "static"])
@pytest.mark.parametrize("arch,extra", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_guesses_right_and_wrong_at_every_depth(tiny, arch, extra, cache_implementation, rows_spy, monkeypatch,
                                                one_torch_thread):
    from transformers.generation import candidate_generator as cg

    model = tiny(arch, **extra)
    ids, n = _prompt(seed=5), 20
    want = _generate(model, ids, n, cache_implementation)
    oracle = _Oracle(len(ids), want[0])
    monkeypatch.setattr(cg.PromptLookupCandidateGenerator, "get_candidates", lambda self, input_ids: oracle(self, input_ids))
    got = _generate(model, ids, n, cache_implementation, prompt_lookup_num_tokens=4)
    _same(arch, got, want)
    assert len(rows_spy) < n - 2, f"{arch}: guesses were not kept"  # fewer steps than tokens


@pytest.mark.parametrize("cache_implementation", CACHES, ids=["dynamic", "static"])
@pytest.mark.parametrize("twin", [True, False], ids=["twin", "other"])
def test_an_assistant_model_keeps_the_plain_answer(tiny, twin, cache_implementation, rows_spy, tmp_path,
                                                   one_torch_thread):
    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    model = tiny("qwen3_moe", **H64)
    if twin:  # a second copy of the model: its guesses are the model's own tokens
        write_tiny_model("qwen3_moe", tmp_path, seed=2, **H64)
    else:
        write_tiny_model("llama", tmp_path, seed=9, vocab_size=model.config.vocab_size, **H64)
    assistant = load_model(tmp_path, model_path=tmp_path)
    ids, n = _prompt(seed=4), 20
    want = _generate(model, ids, n, cache_implementation)
    rows_spy.clear()
    got = _generate(model, ids, n, cache_implementation, assistant_model=assistant)
    _same("qwen3_moe", got, want)
    assert rows_spy and max(rows_spy) > 1
    if twin:
        assert len(rows_spy) < n // 2, "the twin's guesses were not kept"


@pytest.mark.parametrize("arch,extra", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_verify_rows_on_a_dynamic_cache_are_plain_steps(tiny, arch, extra, one_torch_thread):
    """``step_rows`` on a DynamicCache: row r has the bits of the plain step; ``undo`` (or
    transformers' ``crop``) leaves the cache the plain steps would."""
    model = tiny(arch, **extra)
    step = decode_step_for(model)
    rng = np.random.default_rng(7)
    prompt = [int(i) for i in rng.integers(3, 250, 12)]
    toks = [int(i) for i in rng.integers(3, 250, 5)]
    n = len(prompt)

    def prefilled():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    with torch.no_grad():
        plain = prefilled()
        want = [step.step(t, n + i, plain)[0].clone() for i, t in enumerate(toks)]
        for rollback in ("undo", "crop"):
            cache = prefilled()
            logits, undo = step.step_rows(toks, n, cache)
            for i in range(len(toks)):
                assert torch.equal(logits[i], want[i]), f"{arch}: verify row {i} differs from the plain step"
            if rollback == "undo":
                undo(2)
            else:
                cache.crop(-3)
            assert cache.get_seq_length() == n + 2
            for i, t in enumerate(toks[2:]):
                got = step.step(t, n + 2 + i, cache)
                assert torch.equal(got[0], want[2 + i]), f"{arch}: step {2 + i} after {rollback}"
        for a, b in zip(cache.layers, plain.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_multi_token_calls_that_are_not_a_verify_take_the_models_forward(tiny, rows_spy, one_torch_thread):
    """A chunk of a prompt (``logits_to_keep=1``) or a forward asking for every row's logits with no
    ``logits_to_keep`` is the model's own, on a cache that holds a sequence or not."""
    model = tiny("llama", **H64)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), cache=cache, use_cache=True, logits_to_keep=1)
        model(input_ids=torch.tensor([[9, 10, 11]]), cache=cache, use_cache=True, logits_to_keep=1)
        out = model(input_ids=torch.tensor([[12, 13]]), cache=cache, use_cache=True)
    assert not rows_spy and out.logits.shape[1] == 2 and cache.get_seq_length() == 9


def test_sliding_window_layers_are_transformers_own(tiny, rows_spy, one_torch_thread):
    """Gemma-3's local layers: on a dynamic cache assisted decoding makes them record their past (a
    layout the step does not read), so its forwards are the model's own; on a static cache with a
    window shorter than the cache transformers refuses assisted decoding, as without the step."""
    model = tiny("gemma3_text", head_dim=64, sliding_window=8)
    ids = _prompt()
    toks, _ = _generate(model, ids, 12, None, prompt_lookup_num_tokens=3)
    assert len(toks) == 12 and not rows_spy
    with pytest.raises(ValueError, match="cropped"):
        _generate(model, ids, 12, "static", prompt_lookup_num_tokens=3)


def test_fuzz_assisted_greedy_is_plain_greedy(tiny, monkeypatch, one_torch_thread):
    """Any prompt length, guess length and pattern of right / wrong guesses, on a static or a
    dynamic cache: assisted greedy tokens and logits are plain greedy generate()'s, bit for bit."""
    pytest.importorskip("hypothesis")
    from hypothesis import given
    from hypothesis import strategies as st
    from transformers.generation import candidate_generator as cg

    from tests.fuzzing import fuzz_settings

    models = {a: tiny(a, **e) for a, e in [("llama", H64), ("deepseek_v3", {})]}
    guess = {}

    def candidates(self, input_ids):
        prompt_len, answer, pattern, k = guess["now"]
        at = input_ids.shape[1] - prompt_len
        out = list(answer[at:at + min(k, max(len(answer) - at - 1, 0))])
        for i in range(len(out)):
            if pattern[(at + i) % len(pattern)]:
                out[i] = (out[i] + 7) % 250 + 3
        if not out:
            return input_ids, None
        return torch.cat([input_ids, torch.tensor([out], dtype=input_ids.dtype)], dim=1), None

    @fuzz_settings(16, deadline=None, derandomize=True)
    @given(st.sampled_from(sorted(models)), st.sampled_from(CACHES),
           st.lists(st.integers(3, 250), min_size=1, max_size=30), st.integers(1, 6),
           st.lists(st.booleans(), min_size=1, max_size=5), st.integers(2, 14))
    def check(arch, cache_implementation, prompt, k, pattern, n):
        model = models[arch]
        with monkeypatch.context() as m:
            want = _generate(model, prompt, n, cache_implementation)
            guess["now"] = (len(prompt), want[0], pattern, k)
            m.setattr(cg.PromptLookupCandidateGenerator, "get_candidates", candidates)
            got = _generate(model, prompt, n, cache_implementation, prompt_lookup_num_tokens=k)
        _same(arch, got, want)

    check()
