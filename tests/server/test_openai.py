"""OpenAI-compatible routes through the official ``openai`` client."""

from __future__ import annotations

import json
import threading

import pytest

from .conftest import MODEL_NAME

openai = pytest.importorskip("openai")


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


HELLO = [{"role": "user", "content": "Say hello"}]


def test_models_list(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_chat_non_stream(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=5)
    assert r.object == "chat.completion"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens <= 5


def test_chat_stream_with_usage(client):
    text, usage, finish = "", None, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_completion_tokens=6,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish in ("stop", "length")
    assert usage is not None and 0 < usage.completion_tokens <= 6
    # the same greedy request without streaming gives the same text
    r = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_completion_tokens=6, temperature=0)
    assert r.choices[0].message.content == text


def test_per_request_sampling_and_seed(client):
    kw = dict(model=MODEL_NAME, messages=HELLO, max_tokens=12, temperature=1.5, top_p=0.95)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=12).choices[0].message.content
    assert a == b  # same seed, same answer
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {greedy, a}) > 1  # temperature is applied, not ignored


def test_stop_strings(client):
    full = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12).choices[0].text
    assert len(full) >= 4
    stop = full[2:4]
    cut = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12, stop=[stop]).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"


def test_completions_stream_and_batch(client):
    r = client.completions.create(model=MODEL_NAME, prompt=["one", "two"], max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens <= 6
    text = ""
    for chunk in client.completions.create(model=MODEL_NAME, prompt="one", max_tokens=3, stream=True):
        text += chunk.choices[0].text
    assert text == r.choices[0].text
    echo = client.completions.create(model=MODEL_NAME, prompt="one", max_tokens=3, echo=True)
    assert echo.choices[0].text == "one" + text


# ---- tool calls: scripted model output, real app, official client ----------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ScriptedGenerator:
    """Implements the Generator API; answers with scripted text (to force a tool call)."""

    def __init__(self, real, replies):
        self.real, self.replies, self.prompts = real, list(replies), []
        self.last_stats = None

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **template_kwargs):
        return self.real.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **template_kwargs)

    def stream(self, input_ids, params, cancel=None):
        from ktransformers.generation import GenerationStats, TokenEvent

        self.prompts.append(self.real.tokenizer.decode(input_ids))
        text = self.replies.pop(0)
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # split tags across events
        for i, p in enumerate(pieces):
            yield TokenEvent(i, p)
        self.last_stats = GenerationStats(len(input_ids), 0.01, len(pieces), 0.02)
        yield TokenEvent(None, "", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(live_app, make_engine, tiny, stream):
    from ktransformers.generation import Generator

    model, tok = tiny
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    gen = ScriptedGenerator(Generator(model, tok), ["Let me check. " + call, "It is sunny in Paris."])
    with live_app(make_engine(gen)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        if stream:
            calls, content, finish = {}, "", None
            for ch in client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER_TOOL],
                                                     stream=True):
                d = ch.choices[0].delta
                content += d.content or ""
                for tc in d.tool_calls or []:
                    calls[tc.index] = tc
                finish = ch.choices[0].finish_reason or finish
            assert content == "Let me check. "
            assert finish == "tool_calls"
            tc = calls[0]
            tool_calls = [{"id": tc.id, "type": "function",
                           "function": {"name": tc.function.name, "arguments": tc.function.arguments}}]
        else:
            r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER_TOOL])
            m = r.choices[0]
            assert m.finish_reason == "tool_calls"
            assert m.message.content == "Let me check."
            tc = m.message.tool_calls[0]
            tool_calls = [tc.model_dump()]
        assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
        assert tc.id.startswith("call_")
        # the tools were described to the model (the tiny template has no tools support)
        assert "get_weather" in gen.prompts[0] and "<tools>" in gen.prompts[0]

        msgs += [{"role": "assistant", "content": None, "tool_calls": tool_calls},
                 {"role": "tool", "tool_call_id": tc.id, "content": '{"sky": "sunny"}'}]
        r2 = client.chat.completions.create(model=MODEL_NAME, messages=msgs, tools=[WEATHER_TOOL])
        assert r2.choices[0].message.content == "It is sunny in Paris."
        assert r2.choices[0].finish_reason == "stop"
        assert '"city": "Paris"' in gen.prompts[1] and '{"sky": "sunny"}' in gen.prompts[1]


def test_parallel_requests_are_served_in_turn(client):
    out, errors = [], []

    def ask(i):
        try:
            out.append(client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=3))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and len(out) == 4
    assert len({r.choices[0].message.content for r in out}) == 1  # greedy: all the same
