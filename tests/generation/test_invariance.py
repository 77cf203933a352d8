"""Chunk invariance on the real Gemma-3-270M Q4_K_M (every projection on the CPU kernels), bitwise:
a prompt prefilled whole, in chunks of any size (>= 2 tokens), or as a cached prefix plus the
rest leaves the same cache, so the last position's logits and the next decode step's logits are
the same bits.  The kernels' own batch invariance is tests/kernels/test_batch_invariance.py.

Scope (docs/server.md, "Determinism"): the tiers with the prompt flash kernel (AVX2 + FMA and
up), chunks of 2+ tokens (a one-token chunk is a decode step: C++ norms and RoPE, not the prompt
forward's); past the sliding window: tests/generation/test_route_invariance.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .test_real_model import assemble_gemma

pytestmark = pytest.mark.slow


class _NoText:
    eos_token_id = None
    chat_template = None

    def decode(self, ids, **kw):
        return ""


@pytest.fixture(scope="module")
def gemma():
    from ktransformers import load_model

    torch.set_num_threads(2)
    return load_model(assemble_gemma())


def _run(model, ids, chunk, split=None):
    """Last-position logits of the prefill and of one decode step after it."""
    from ktransformers.generation import Generator

    g = Generator(model, _NoText(), chunk_size=chunk)
    cache = g.new_cache(1024)  # past the sliding window (512), as a server or local_chat cache is
    with torch.inference_mode():
        if split:  # a cached prefix: its tokens prefilled first, the rest as one continuation
            g.prefill(ids[:split], cache)
            last = g._forward(torch.tensor([ids[split:]]), split, cache)
        else:
            last = g.prefill(ids, cache)
        nxt = g._forward(torch.tensor([[int(last.argmax())]]), len(ids), cache)
    return last.clone(), nxt.clone()


@pytest.mark.parametrize("chunk,split", [(7, None), (64, None), (97, None), (4096, 130), (50, 300)])
def test_chunked_and_cached_prefill_give_the_same_bits(gemma, chunk, split):
    from ktransformers.kernels.attention import flash_attention_supported

    if not flash_attention_supported():
        pytest.skip("no prompt flash kernel on this tier: transformers' sdpa is not chunk-invariant")
    ids = [int(i) for i in np.random.default_rng(3).integers(100, 30000, 420)]  # < the sliding window
    ref_last, ref_next = _run(gemma, ids, 4096)
    last, nxt = _run(gemma, ids, chunk, split)
    assert torch.equal(last, ref_last), f"prefill logits differ: max {(last - ref_last).abs().max():.3g}"
    assert torch.equal(nxt, ref_next), f"decode logits differ: max {(nxt - ref_next).abs().max():.3g}"


def _greedy_rows(model, plan, steps, page_size=16):
    """Drive a BatchRunner: ``plan[sid] = (start_step, prompt, chunk)``; each sequence reads its
    prompt ``chunk`` tokens a step from ``start_step``, then decodes greedily.  Returns the logits
    rows of sequence 0 (its last prompt chunk's and its decode steps')."""
    from ktransformers.generation.paged import BatchRunner

    runner = BatchRunner(model, page_size=page_size, num_pages=256)
    state = {sid: {"done": 0, "next": None} for sid in plan}
    rows = []
    for step in range(steps):
        chunks, reading = [], set()
        for sid, (start, prompt, chunk) in plan.items():
            st = state[sid]
            if step < start:
                continue
            if step == start:
                runner.begin(sid)
            if st["done"] < len(prompt):
                toks = prompt[st["done"]:st["done"] + chunk]
                st["done"] += len(toks)
                chunks.append((sid, toks))
                reading.add(sid)
            else:
                chunks.append((sid, [st["next"]]))
        logits = runner.step(chunks, prompt=reading)
        for (sid, _), row in zip(chunks, logits):
            st = state[sid]
            if st["done"] >= len(plan[sid][1]):
                st["next"] = int(row.argmax())
                if sid == 0:
                    rows.append(row.clone())
    return rows


def test_batching_server_rows_do_not_depend_on_the_other_requests(gemma):
    """The batching engine's answer for one request, alone and beside others that start, read their
    prompts (mixed steps) and decode at other times: the same logits, bit for bit, every step."""
    rng = np.random.default_rng(5)
    prompt = [int(i) for i in rng.integers(100, 30000, 150)]
    alone = _greedy_rows(gemma, {0: (0, prompt, 64)}, steps=14)
    others = {1: (1, [int(i) for i in rng.integers(100, 30000, 200)], 48),
              2: (4, [int(i) for i in rng.integers(100, 30000, 90)], 30),
              3: (0, [int(i) for i in rng.integers(100, 30000, 20)], 64)}
    crowded = _greedy_rows(gemma, {0: (0, prompt, 64), **others}, steps=14)
    assert len(alone) == len(crowded) == 12
    for i, (a, b) in enumerate(zip(alone, crowded)):
        assert torch.equal(a, b), f"step {i}: logits differ beside other requests (max {(a - b).abs().max():.3g})"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    made = {}

    def get(arch):
        if arch not in made:
            d = tmp_path_factory.mktemp(f"invariance-{arch}")
            write_tiny_model(arch, d, seed=1)
            made[arch] = load_model(d, model_path=d)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "gemma3_text"])
def test_tiny_families_batching_rows_do_not_depend_on_the_other_requests(tiny, arch):
    model = tiny(arch)
    rng = np.random.default_rng(11)
    prompt = [int(i) for i in rng.integers(3, 250, 30)]
    alone = _greedy_rows(model, {0: (0, prompt, 8)}, steps=10, page_size=4)
    others = {1: (1, [int(i) for i in rng.integers(3, 250, 25)], 6),
              2: (3, [int(i) for i in rng.integers(3, 250, 9)], 5)}
    crowded = _greedy_rows(model, {0: (0, prompt, 8), **others}, steps=10, page_size=4)
    assert len(alone) == len(crowded) == 7
    for i, (a, b) in enumerate(zip(alone, crowded)):
        assert torch.equal(a, b), f"{arch} step {i}: logits differ beside other requests"
