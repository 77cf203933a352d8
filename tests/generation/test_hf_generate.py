"""transformers' ``generate()`` on an injected model decodes on the lean step (generation/hf_generate.py).

Checked against the model's own forward (``KT_LEAN_DECODE=0``, the same injected operators):
* per-step logits (``output_logits``) within 1e-5 x max|logits| (the lean step's own tolerance
  against the generic forward, tests/generation/test_lean_decode.py), with a dynamic and with a
  static cache, and the greedy tokens equal wherever the generic forward's top-1 margin exceeds it;
* the dynamic cache left as its layers' own ``update`` leaves it (lengths, sliding windows past
  their size, values within 1e-5), also when a generic forward runs between lean steps;
* greedy tokens identical to the ``Generator``'s (local_chat's loop) on the same prompt;
* calls the step does not reproduce (a padded batch, ``output_attentions``, autograd on) take
  the model's forward, and the step is not called.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from ktransformers import load_model
from ktransformers.generation import Generator, SamplingParams
from ktransformers.generation.decode_step import DecodeStep

from .test_invariance import _NoText

ARCHS = ["llama", "qwen3", "gemma3_text", "qwen3_moe"]


def _prompt(n=10, seed=3):
    return [int(i) for i in torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.fixture
def spy(monkeypatch):
    """Counts lean steps that answered (returned logits)."""
    calls = []
    real = DecodeStep.step

    def step(self, *a):
        out = real(self, *a)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(DecodeStep, "step", step)
    return calls


def _generate(model, ids, n, cache_implementation=None, **kw):
    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=n,
                           output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=cfg, cache_implementation=cache_implementation,
                             **kw)
    return out.sequences[0, len(ids):].tolist(), torch.stack([g[0] for g in out.logits])


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_decodes_on_the_lean_step(arch, cache_implementation, tiny_model_dir, spy, monkeypatch,
                                           one_torch_thread):
    d = tiny_model_dir(arch)
    model = load_model(d, model_path=d)
    ids, n = _prompt(), 24  # gemma3's tiny sliding window is 8: the window rolls / slides
    got_tokens, got = _generate(model, ids, n, cache_implementation)
    assert sum(spy) == n - 1, f"{arch}: {sum(spy)} of {n - 1} decode steps on the lean step"
    monkeypatch.setenv("KT_LEAN_DECODE", "0")
    spy.clear()
    want_tokens, want = _generate(model, ids, n, cache_implementation)
    assert not spy
    # teacher-forced comparison only up to the first near tie of the generic forward
    tol = 1e-5 * want.abs().max().item()
    for i in range(n):
        assert (got[i] - want[i]).abs().max().item() <= tol, f"{arch}: step {i} logits off the generic forward"
        top2 = want[i].topk(2).values
        if top2[0] - top2[1] <= tol:
            break
        assert got_tokens[i] == want_tokens[i]
    assert i >= n // 2, f"{arch}: only {i} clear steps; the check would be vacuous"


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_generate_gives_the_generators_tokens(arch, tiny_model_dir, one_torch_thread):
    d = tiny_model_dir(arch)
    model = load_model(d, model_path=d)
    gen = Generator(model, _NoText())
    gen.eos_ids = set()
    ids = _prompt(12, seed=5)
    _, ours, _ = gen.generate(ids, SamplingParams(max_new_tokens=20))
    for cache in (None, "static"):
        assert _generate(model, ids, 20, cache)[0] == list(ours), f"{arch}, cache {cache}"


def test_dynamic_cache_ends_as_its_own_update_leaves_it(tiny_model_dir, spy, one_torch_thread):
    """Past the sliding window and past the growth buffers (the compaction branch runs), with a
    two-token generic forward in the middle: the lean cache equals the generic one."""
    d = tiny_model_dir("gemma3_text")
    model = load_model(d, model_path=d)
    step = DecodeStep.build(model)
    ids = _prompt(6)
    toks = [int(t) for t in torch.randint(5, 300, (110,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
        for c in caches:
            model(input_ids=torch.tensor([ids]), cache=c, use_cache=True)
        pos = len(ids)
        for i, t in enumerate(toks):
            if i == 50:  # a generic forward of two tokens on both: the lean buffers are re-adopted after it
                for c in caches:
                    model(input_ids=torch.tensor([[t, t]]), cache=c, position_ids=torch.tensor([[pos, pos + 1]]),
                          use_cache=True)
                pos += 2
                continue
            ref = model(input_ids=torch.tensor([[t]]), cache=caches[0], position_ids=torch.tensor([[pos]]),
                        use_cache=True).logits[0, -1]
            with pytest.MonkeyPatch.context() as m:
                m.setenv("KT_LEAN_DECODE", "1")
                assert step.accepts(caches[1])
                got = step.step(t, pos, caches[1])[0]
            assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), f"token {i}"
            pos += 1
    for la, lb in zip(*[c.layers for c in caches]):
        assert type(la) is type(lb)
        assert la.get_seq_length() == lb.get_seq_length()
        assert la.keys.shape == lb.keys.shape
        assert torch.allclose(la.keys, lb.keys, atol=1e-5 * la.keys.abs().max().item(), rtol=1e-5)
        assert torch.allclose(la.values, lb.values, atol=1e-5 * la.values.abs().max().item(), rtol=1e-5)
    assert caches[1].get_seq_length() == pos
    assert any(getattr(lay, "is_sliding", False) and lay.keys.shape[-2] < pos for lay in caches[1].layers)


def test_calls_the_step_does_not_reproduce_take_the_models_forward(tiny_model_dir, spy, one_torch_thread):
    d = tiny_model_dir("qwen3")
    model = load_model(d, model_path=d)
    a, b = _prompt(8, seed=1), _prompt(5, seed=2)
    # a padded batch of two (left padding): the generic forward
    x = torch.tensor([a, [0] * 3 + b])
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    with torch.no_grad():
        model.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert not spy
    # one sequence with a mask hiding a prompt token: the generic forward
    with torch.no_grad():
        model.generate(torch.tensor([a]), attention_mask=torch.tensor([[0] + [1] * 7]), max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
    assert not spy
    # asking for attentions: the generic forward
    cfg = GenerationConfig(do_sample=False, max_new_tokens=3, pad_token_id=0, output_attentions=True,
                           return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([a]), generation_config=cfg)
    assert not spy and len(out.attentions) == 3
    # autograd on (a training script's forward): the generic forward
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([a]), cache=cache, use_cache=True)
    out = model(input_ids=torch.tensor([[a[0]]]), cache=cache, position_ids=torch.tensor([[8]]), use_cache=True)
    assert not spy and out.logits.shape[:2] == (1, 1)
    # a plain mask of ones over the positions so far: the step
    with torch.no_grad():
        model.generate(torch.tensor([a]), attention_mask=torch.ones(1, 8, dtype=torch.long), max_new_tokens=4,
                       do_sample=False, pad_token_id=0)
    assert sum(spy) == 3
    # a forward call of the user's own (the cache holds 9 positions) with a 2-D keep mask (1 = a real
    # token): ones -> the step, a hidden position -> the model's forward
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[a[0]]]), cache=cache, position_ids=torch.tensor([[9]]),
                    attention_mask=torch.ones(1, 10, dtype=torch.long), use_cache=True)
        assert sum(spy) == 4 and out.logits.shape == (1, 1, model.config.vocab_size)
        model(input_ids=torch.tensor([[a[1]]]), cache=cache, position_ids=torch.tensor([[10]]),
              attention_mask=torch.tensor([[0] + [1] * 10]), use_cache=True)
        assert sum(spy) == 4


def test_inject_entry_point_installs_it(tiny_model_dir):
    """``ktransformers.inject`` (the user's own script) gets it as load_model does; the rule
    engine's own ``optimize.inject`` is left bare."""
    import ktransformers
    from ktransformers.optimize import inject as bare_inject
    from ktransformers.optimize_rules import default_rule_file
    from ktransformers.loading import load_config

    d = tiny_model_dir("llama")
    rules = default_rule_file(load_config(d, None), cuda=False)
    m1 = ktransformers.inject(ktransformers.build_model(load_config(d, None)), rules, d, allow_unmatched=True)
    m2 = bare_inject(ktransformers.build_model(load_config(d, None)), rules, d, allow_unmatched=True)
    assert "_kt_lean_forward" in m1.__dict__ and "_kt_lean_forward" not in m2.__dict__
    assert "_kt_lean_forward" in load_model(d, model_path=d).__dict__
