"""Every route tokenizes a prompt as the model's tokenizer does by default (its own BOS
setting) and so gives local_chat's greedy answer for the same prompt.

The tiny model's tokenizer gets a BOS post-processor here (as Gemma's and Llama's have): a route
that tokenizes without it would see a different prompt and, on this random model, answer
differently.
"""

from __future__ import annotations

import copy
import io
import json

import httpx
import pytest

from .conftest import MODEL_NAME

PROMPT = "The three primary colors are"
N = 8
BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bos_tokenizer(tiny):
    from tokenizers import processors

    _, base = tiny
    tok = copy.deepcopy(base)
    bos_id = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    tok.chat_template = None  # a base model: local_chat sends the plain text
    assert tok.encode(PROMPT)[0] == bos_id and tok.encode(PROMPT, add_special_tokens=False)[0] != bos_id
    return tok


@pytest.fixture(scope="module")
def local_chat_answer(tiny, bos_tokenizer):
    from ktransformers.generation import Generator, SamplingParams
    from ktransformers.local_chat import answer

    model, _ = tiny
    gen = Generator(model, bos_tokenizer, max_cache_len=2048)
    text, _ = answer(gen, [{"role": "user", "content": PROMPT}], SamplingParams(temperature=0, max_new_tokens=N),
                     False, out=io.StringIO())
    without_bos, _, _ = gen.generate(gen.encode(PROMPT, add_special_tokens=False),
                                     SamplingParams(temperature=0, max_new_tokens=N))
    assert text and text != without_bos, "the fixture cannot tell a missing BOS apart"
    return text


def test_every_route_gives_local_chats_greedy_answer(live_app, make_engine, tiny, bos_tokenizer,
                                                     local_chat_answer):
    from ktransformers.generation import Generator

    model, _ = tiny
    engine = make_engine(Generator(model, bos_tokenizer, max_cache_len=2048), max_new_tokens=N)
    engine.tokenizer = bos_tokenizer
    msgs = [{"role": "user", "content": PROMPT}]
    with live_app(engine) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        got = {
            "/v1/completions": c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N})
            .json()["choices"][0]["text"],
            "/v1/chat/completions": c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": N})
            .json()["choices"][0]["message"]["content"],
            "/api/generate": c.post("/api/generate", json={"model": MODEL_NAME, "prompt": PROMPT, "stream": False,
                                                           "options": {"num_predict": N}}).json()["response"],
            "/api/generate raw": c.post("/api/generate", json={"model": MODEL_NAME, "prompt": PROMPT, "raw": True,
                                                               "stream": False, "options": {"num_predict": N}})
            .json()["response"],
            "/api/chat": c.post("/api/chat", json={"model": MODEL_NAME, "messages": msgs, "stream": False,
                                                   "options": {"num_predict": N}}).json()["message"]["content"],
        }
        a = c.post("/v1/assistants", json={}).json()
        run = c.post("/v1/threads/runs", json={"assistant_id": a["id"], "stream": True, "max_completion_tokens": N,
                                               "thread": {"messages": msgs}})
        lines = run.text.splitlines()
        done = [json.loads(lines[i + 1][len("data: "):]) for i, ln in enumerate(lines)
                if ln in ("event: thread.message.completed", "event: thread.message.incomplete")]
        got["Assistants run"] = done[0]["content"][0]["text"]["value"]
    assert got == {k: local_chat_answer for k in got}
