"""Chat completions: <think>…</think> goes to ``reasoning_content`` (DeepSeek's API shape);
DeepSeek's tool-call tokens become ``tool_calls``.  Scripted model output, official client."""

from __future__ import annotations

import json

import pytest

from .conftest import MODEL_NAME
from .test_openai import WEATHER_TOOL, ScriptedGenerator

openai = pytest.importorskip("openai")

THOUGHT = "<think>\nPlan: greet back.\n</think>\n\nHello!"
DS_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


@pytest.fixture
def scripted(live_app, make_engine, tiny):
    from ktransformers.generation import Generator

    def make(replies):
        model, tok = tiny
        return live_app(make_engine(ScriptedGenerator(Generator(model, tok), replies)))

    return make


def test_reasoning_content_plain_and_streamed(scripted):
    with scripted([THOUGHT, THOUGHT, "no thoughts"]) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Hi"}]
        m = c.chat.completions.create(model=MODEL_NAME, messages=msgs).choices[0].message
        assert m.content == "Hello!" and m.reasoning_content == "Plan: greet back."
        reasoning = content = ""
        for ch in c.chat.completions.create(model=MODEL_NAME, messages=msgs, stream=True):
            d = ch.choices[0].delta if ch.choices else None
            if d is not None:
                reasoning += getattr(d, "reasoning_content", None) or ""
                content += d.content or ""
        assert (reasoning, content) == ("Plan: greet back.", "Hello!")
        plain = c.chat.completions.create(model=MODEL_NAME, messages=msgs).choices[0].message
        assert plain.content == "no thoughts" and plain.reasoning_content is None


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_tool_tokens_in_chat(scripted, stream):
    with scripted([DS_CALL]) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL])
        if stream:
            calls, finish = [], None
            for ch in c.chat.completions.create(stream=True, **kw):
                calls += ch.choices[0].delta.tool_calls or []
                finish = ch.choices[0].finish_reason or finish
        else:
            r = c.chat.completions.create(**kw).choices[0]
            calls, finish = r.message.tool_calls, r.finish_reason
        assert finish == "tool_calls" and calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
