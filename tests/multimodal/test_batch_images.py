"""Pictures through the batching engine (the server's default backend): a prompt with pictures is
read whole, in a step of its own, by the model's own forward with the pictures; its decode steps
share the batch with other requests at M-RoPE positions shifted by the pictures' offset.  Every
answer is token for token transformers' generate() on the unmodified tiny Qwen3-VL-MoE for that
request alone, whatever runs beside it, after a preemption too, and with the prefix cache on (its
keys hold the pictures' content: two pictures under the same text give two answers; more in
test_image_prefix_cache.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ktransformers.generation import Generator
from ktransformers.server.batch_engine import BatchEngine, runner_class
from ktransformers.server.engine import GenerationRequest, SamplingDefaults

from .conftest import photo_like

MAX_NEW = 10


def _prompt(tok, support, question, images):
    content = "".join(f"{support.markup}\n" for _ in images) + question
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    if not images:
        return tok.encode(text, add_special_tokens=False)
    return support.prompt(text, images)


def _reference(hf, prompt) -> list[int]:
    """transformers' greedy tokens for ``prompt`` alone (no EOS stop: the engine is given none)."""
    vision = getattr(prompt, "vision", None)
    inputs = {"input_ids": torch.tensor([list(prompt)]), **(vision.inputs if vision is not None else {})}
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _engine(model, tok, support, *, num_pages=64, page_size=16, chunk_size=16, prefix_cache=None, runner=None):
    runner = (runner or runner_class())(model, page_size=page_size, num_pages=num_pages)
    if prefix_cache is not None:
        prefix_cache = prefix_cache(runner.pool)
    engine = BatchEngine(Generator(model, tok), tok, runner, model_name="tiny-vl", max_context=4096, max_batch_size=4,
                         chunk_size=chunk_size, defaults=SamplingDefaults(max_new_tokens=MAX_NEW), max_queue=16,
                         prefix_cache=prefix_cache, images=support)
    engine.generator.eos_ids = set()  # every answer runs MAX_NEW tokens, as the reference does
    return engine


async def _run(engine, prompt, delay=0.0):
    await asyncio.sleep(delay)
    stream = await engine.submit(GenerationRequest(prompt, max_new_tokens=MAX_NEW))
    toks = [ev.token_id async for ev in stream if ev.token_id is not None]
    return toks, stream.cached_tokens


def _serve(engine, prompts, delays=None):
    async def main():
        engine.start()
        try:
            return await asyncio.gather(*[_run(engine, p, d) for p, d in zip(prompts, delays or [0.0] * len(prompts))])
        finally:
            engine.shutdown()
    return asyncio.run(main())


@pytest.mark.parametrize("runner", ["paged", "reference"])
def test_pictures_and_text_together_equal_each_alone(vl, runner):
    """On the paged runner and on the reference runner (one cache per request, the oracle and the
    fallback)."""
    from ktransformers.server.reference_runner import BatchRunner as ReferenceRunner

    tok, support, hf, model = vl
    prompts = [_prompt(tok, support, "What is in the picture?", [photo_like()]),
               _prompt(tok, support, "Tell me a story about the sea and the sky", []),
               _prompt(tok, support, "Compare them.", [photo_like(seed=1), photo_like(70, 80, seed=2)]),
               _prompt(tok, support, "Describe it", [photo_like(seed=3)])]
    want = [_reference(hf, p) for p in prompts]
    assert len({tuple(w) for w in want}) == len(want)
    engine = _engine(model, tok, support, runner=ReferenceRunner if runner == "reference" else None)
    got = _serve(engine, prompts, delays=[0.0, 0.0, 0.3, 0.6])
    assert [g for g, _ in got] == want
    assert engine.counts["completed"] == 4 and engine.runner.pool.used_count() == 0


def test_preempted_picture_prompt_is_read_again_with_its_pictures(vl):
    """A pool too small for all at once: the youngest request is preempted and read again
    (prompt + the tokens it generated, with the pictures); the answers do not change."""
    tok, support, hf, model = vl
    prompts = [_prompt(tok, support, "What is in the picture?", [photo_like()]),
               _prompt(tok, support, "Describe it", [photo_like(seed=3)])]
    want = [_reference(hf, p) for p in prompts]
    # room for both prompts, not for both answers: the younger is preempted while both decode
    engine = _engine(model, tok, support, page_size=4, num_pages=sum((len(p) + 3) // 4 for p in prompts) + 2)
    got = _serve(engine, prompts)
    assert [g for g, _ in got] == want
    assert engine.scheduler.preemptions > 0


def test_prefix_cache_never_answers_another_picture(vl, tmp_path):
    """Same text, different pictures, prefix cache on: each answer is its own (the one it gets
    alone); the other picture hits only the text before it, the same picture hits through it, text
    prompts still share the cache."""
    from PIL import ImageOps

    from ktransformers.server.prefix_cache import PrefixCache

    tok, support, hf, model = vl
    a = _prompt(tok, support, "What is in the picture?", [photo_like(seed=0)])
    b = _prompt(tok, support, "What is in the picture?", [ImageOps.invert(photo_like(seed=5))])
    assert list(a) == list(b)  # the same token ids: only the pictures differ
    want = [_reference(hf, a), _reference(hf, b)]
    assert want[0] != want[1]
    engine = _engine(model, tok, support, page_size=4, prefix_cache=lambda pool: PrefixCache(
        pool, fingerprint="t", page_size=4, ram_bytes=2 ** 26))
    got = _serve(engine, [a, b, a], delays=[0.0, 0.5, 1.0])
    assert [g for g, _ in got] == [want[0], want[1], want[0]]
    (start, _, _), = a.vision.spans()
    assert [c for _, c in got] == [0, start // 4 * 4, (len(a) - 1) // 4 * 4]
    text = _prompt(tok, support, "Tell me a story about the sea and the sky", [])
    again = _serve(engine, [text, text], delays=[0.0, 0.8])
    assert again[0][0] == again[1][0] == _reference(hf, text) and again[1][1] > 0
