"""Route invariance, bitwise: the same request gives the same logits through every route a user
decodes with -- the single-sequence ``Generator`` (local_chat, the single-request server), with its
prompt whole or in chunks; the batching server's ``BatchRunner`` alone and beside other requests;
and transformers' ``generate()`` on the injected model -- on the prefill's last position and on
every greedy decode step after it.

Why it holds: every route decodes through the one ``DecodeStep`` (generation/decode_step.py), whose
attention kernel reads a cache layer and a page pool alike (``decode_ops.attend_rows``), and reads a
prompt with the same flash kernel (over a cache or over pages, ``flash_attn_prefill``), all on the
batch-invariant GEMMs.  Without the paged flash kernel the batching server's prompt attention is
transformers' sdpa over the gathered pages, and the answers part after a few tokens (the first
check below fails).

Scope (docs/server.md, "Determinism"): the families the decode step serves (Gemma-3 text, Llama /
Mistral / Qwen2 / Qwen3 / Qwen-MoE) on the tiers with the prompt flash kernel (AVX2 + FMA and up;
elsewhere both routes read prompts with transformers' sdpa, over differently shaped key tensors),
sliding windows included (a chunk past the window reads the rolled layer through the same kernel).
DeepSeek MLA: the Generator, generate() and the batching server, the prompt whole or in chunks
(alone and beside others), on every tier: MLA's prompt attention is ``mla.causal_prompt_attention``
(torch, in blocks fixed from position 0) over a cache and over the gathered latent pages alike.
Qwen3-Next: the Generator and generate(), its DeltaNet layers token by token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .test_invariance import _greedy_rows, _NoText
from .test_real_model import assemble_gemma


def _flash_or_skip():
    from ktransformers.operators.cpu_attention import flash_mode

    if flash_mode() is None:
        pytest.skip("no prompt flash kernel on this tier (or KT_FLASH_ATTN=0): the routes read prompts with sdpa")


def _generator_rows(model, prompt, steps, chunk):
    from ktransformers.generation import Generator

    g = Generator(model, _NoText(), chunk_size=chunk)
    cache = g.new_cache(len(prompt) + steps + 8)
    rows = []
    with torch.inference_mode():
        rows.append(g.prefill(prompt, cache)[0].clone())
        for i in range(steps):
            pos = len(prompt) + i
            rows.append(g._forward(torch.tensor([[int(rows[-1].argmax())]]), pos, cache)[0].clone())
    return rows


def _generate_rows(model, prompt, steps, cache_implementation=None):
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=steps + 1,
                           output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=cfg, cache_implementation=cache_implementation)
    return [g[0].float() for g in out.logits]


def _same(name, got, want):
    assert len(got) >= len(want) - 1
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{name}: row {i} differs from the Generator's (max {(a - b).abs().max():.3g})"


def _check_routes(model, prompt, steps, chunk, others, page_size, generate=True):
    want = _generator_rows(model, prompt, steps, chunk=8192)
    # the batching server, the prompt in one step, then in chunks; alone and with others
    _same("batching server", _greedy_rows(model, {0: (0, prompt, 8192)}, steps=steps + 1, page_size=page_size), want)
    n_chunks = -(-len(prompt) // chunk)
    crowded = _greedy_rows(model, {0: (0, prompt, chunk), **others}, steps=steps + n_chunks, page_size=page_size)
    _same("batching server, chunked, beside others", crowded, want)
    _same(f"Generator, chunks of {chunk}", _generator_rows(model, prompt, steps, chunk=chunk), want)
    if generate:
        _same("generate()", _generate_rows(model, prompt, steps), want)
        _same("generate(), static cache", _generate_rows(model, prompt, steps, "static"), want)


@pytest.fixture(scope="module")
def gemma():
    from ktransformers import load_model

    torch.set_num_threads(2)
    return load_model(assemble_gemma())


@pytest.mark.slow
def test_gemma_routes_give_the_same_bits(gemma):
    _flash_or_skip()
    rng = np.random.default_rng(5)
    prompt = [int(i) for i in rng.integers(100, 30000, 150)]
    others = {1: (1, [int(i) for i in rng.integers(100, 30000, 200)], 48),
              2: (3, [int(i) for i in rng.integers(100, 30000, 90)], 30)}
    _check_routes(gemma, prompt, steps=10, chunk=64, others=others, page_size=16)


@pytest.mark.slow
def test_gemma_routes_past_the_sliding_window(gemma):
    """700 tokens: the sliding layers' window (512) rolls during the chunked prefills."""
    _flash_or_skip()
    rng = np.random.default_rng(4)
    prompt = [int(i) for i in rng.integers(100, 30000, 700)]
    others = {1: (2, [int(i) for i in rng.integers(100, 30000, 90)], 30)}
    _check_routes(gemma, prompt, steps=4, chunk=100, others=others, page_size=16)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "qwen2_moe", "gemma3_text", "glm4_moe"])
def test_tiny_families_routes_give_the_same_bits(tiny, arch):
    _flash_or_skip()
    # head_dim 64: the prompt flash kernel's smallest head; gemma3's window past the request, and
    # qwen2_moe's shared expert 64 wide (scope: torch's activations over a prompt's rows of a width
    # that is not a multiple of 32 put a row's tail lanes through the scalar function, by its place;
    # GLM-4-MoE's router sigmoid over 32 experts for the same reason)
    extra = {"gemma3_text": {"sliding_window": 64}, "qwen2_moe": {"shared_expert_intermediate_size": 64},
             "glm4_moe": {"n_routed_experts": 32}}
    model = tiny(arch, head_dim=64, **extra.get(arch, {}))
    rng = np.random.default_rng(7)
    prompt = [int(i) for i in rng.integers(3, 250, 30)]
    others = {1: (1, [int(i) for i in rng.integers(3, 250, 25)], 6), 2: (2, [int(i) for i in rng.integers(3, 250, 9)], 5)}
    _check_routes(model, prompt, steps=8, chunk=7, others=others, page_size=4)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gemma3_text"])
def test_one_token_prompt_chunks_give_the_same_bits(tiny, arch):
    """A prompt read in chunks that leave one token (a tail of one, or one token at a time) is read
    by the prompt forward, not taken for a decoding row: the same bits as the prompt read whole, on
    the Generator and on the batching server beside others."""
    _flash_or_skip()
    extra = {"gemma3_text": {"sliding_window": 64}}
    model = tiny(arch, head_dim=64, **extra.get(arch, {}))
    rng = np.random.default_rng(9)
    prompt = [int(i) for i in rng.integers(3, 250, 29)]
    want = _generator_rows(model, prompt, 4, chunk=8192)
    for chunk in (1, 14, 28):  # 28 x 1, 14 + 14 + 1, 28 + 1
        _same(f"Generator, chunks of {chunk}", _generator_rows(model, prompt, 4, chunk=chunk), want)
        others = {1: (0, [int(i) for i in rng.integers(3, 250, 9)], 4)}
        n_chunks = -(-len(prompt) // chunk)
        rows = _greedy_rows(model, {0: (0, prompt, chunk), **others}, steps=4 + n_chunks, page_size=4)
        _same(f"batching server, chunks of {chunk}", rows, want)


def test_gemma_past_its_sliding_window_routes_give_the_same_bits(tiny):
    """Chunks that start past the window read a rolled sliding layer (the single-sequence routes:
    its last keys and the chunk's, from a position past 0) or the pages (the batching server): the
    same kernel, the same bits, whole or in chunks."""
    _flash_or_skip()
    model = tiny("gemma3_text", head_dim=64, sliding_window=16)
    rng = np.random.default_rng(9)
    prompt = [int(i) for i in rng.integers(3, 250, 45)]
    others = {1: (1, [int(i) for i in rng.integers(3, 250, 20)], 6)}
    _check_routes(model, prompt, steps=10, chunk=7, others=others, page_size=4)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_generator_and_generate_give_the_same_bits(tiny, arch, monkeypatch):
    """DeepSeek MLA: the Generator, transformers' generate() (dynamic and static cache) and the
    batching server read the prompt (whole, or in chunks of 7 and of 1 beside other requests) with
    the model's forward and decode through the one step over the latent cache or pages: the same
    bits."""
    from ktransformers.generation.decode_step import decode_step_for

    model = tiny(arch)
    step = decode_step_for(model)
    calls = []
    own = step.step
    monkeypatch.setattr(step, "step", lambda *a: calls.append(1) or own(*a))
    rng = np.random.default_rng(7)
    prompt = [int(i) for i in rng.integers(3, 250, 30)]
    want = _generator_rows(model, prompt, steps=8, chunk=8192)
    _same("batching server", _greedy_rows(model, {0: (0, prompt, 8192)}, steps=9, page_size=4), want)
    for chunk in (7, 1):
        _same(f"Generator, chunks of {chunk}", _generator_rows(model, prompt, steps=8, chunk=chunk), want)
        others = {1: (1, [int(i) for i in rng.integers(3, 250, 25)], 6),
                  2: (2, [int(i) for i in rng.integers(3, 250, 9)], 5)}
        n_chunks = -(-len(prompt) // chunk)
        crowded = _greedy_rows(model, {0: (0, prompt, chunk), **others}, steps=8 + n_chunks, page_size=4)
        _same(f"batching server, chunks of {chunk}, beside others", crowded, want)
    for cache in (None, "static"):
        del calls[:]
        _same(f"generate(), {cache or 'dynamic'} cache", _generate_rows(model, prompt, 8, cache), want)
        assert len(calls) >= 8, f"generate() with a {cache or 'dynamic'} cache did not decode through the step"


def test_qwen3_next_generator_and_generate_give_the_same_bits(tiny):
    """Qwen3-Next (gated-DeltaNet layers token by token, operators/cpu_linear_attention.py; one
    request at a time: no batching server): the Generator with the prompt whole, in chunks of 7 and
    of 1, and transformers' generate(), on the prompt's last position and 8 greedy decode steps; and
    the answer read back as a prompt gives the last decode row's bits."""
    _flash_or_skip()
    model = tiny("qwen3_next", head_dim=64)
    rng = np.random.default_rng(7)
    prompt = [int(i) for i in rng.integers(3, 250, 30)]
    want = _generator_rows(model, prompt, steps=8, chunk=8192)
    for chunk in (7, 1):
        _same(f"Generator, chunks of {chunk}", _generator_rows(model, prompt, steps=8, chunk=chunk), want)
    _same("generate()", _generate_rows(model, prompt, 8), want)
    answer = [int(r.argmax()) for r in want[:-1]]
    again = _generator_rows(model, prompt + answer, steps=0, chunk=8192)
    assert torch.equal(again[0], want[-1]), "the answer read as a prompt gives other bits than its decode"
