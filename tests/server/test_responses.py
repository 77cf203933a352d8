"""Responses API through the official ``openai`` client: plain and streamed, chaining, tools,
reasoning split, background + cancel, errors."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import MODEL_NAME
from .test_openai import WEATHER_TOOL, ScriptedGenerator

openai = pytest.importorskip("openai")
if not hasattr(openai.OpenAI, "responses"):  # pragma: no cover - older clients
    pytest.skip("this openai client has no Responses API", allow_module_level=True)

TOOL = {"type": "function", **WEATHER_TOOL["function"]}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_create_string_and_items(client):
    r = client.responses.create(model=MODEL_NAME, input="Say hello", max_output_tokens=6, temperature=0,
                                metadata={"k": "v"})
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.metadata == {"k": "v"} and r.model == MODEL_NAME
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 6
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Say hello"}]}]
    same = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=6, temperature=0)
    assert same.output_text == r.output_text  # the same prompt either way
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.status == r.status
    inputs = client.responses.input_items.list(r.id).data
    assert [i.type for i in inputs] == ["message"] and inputs[0].content[0].text == "Say hello"
    other = client.responses.create(model=MODEL_NAME, input="Say hello", instructions="Answer in French.",
                                    max_output_tokens=6, temperature=0)
    assert other.instructions == "Answer in French."


def test_previous_response_chaining_and_delete(client, server):
    a = client.responses.create(model=MODEL_NAME, input="My name is Ada.", max_output_tokens=4)
    b = client.responses.create(model=MODEL_NAME, input="What is my name?", previous_response_id=a.id,
                                max_output_tokens=4)
    assert b.previous_response_id == a.id
    # the chained prompt holds the first turn: longer than the second question alone
    alone = client.responses.create(model=MODEL_NAME, input="What is my name?", max_output_tokens=4)
    assert b.usage.input_tokens > alone.usage.input_tokens + a.usage.output_tokens
    client.responses.delete(alone.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_nope")
    unstored = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stream_events_match_plain(client):
    kw = dict(model=MODEL_NAME, input="Tell me a story", max_output_tokens=8, temperature=0)
    events, deltas = [], ""
    with client.responses.stream(**kw) as s:
        for ev in s:
            events.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response  # get_final_response() wants 'completed'; a random model hits the limit
    plain = client.responses.create(**kw)
    assert events[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added", "response.output_text.delta"]
    assert events[-4:] == ["response.output_text.done", "response.content_part.done",
                           "response.output_item.done", events[-1]]
    assert events[-1] in ("response.completed", "response.incomplete")
    assert deltas == final.output_text == plain.output_text
    assert client.responses.retrieve(final.id).output_text == deltas


def test_raw_sse_sequence_numbers(server):
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    datas = [json.loads(b.split("data: ", 1)[1]) for b in blocks]
    assert [b.split("\n")[0] for b in blocks] == [f"event: {d['type']}" for d in datas]
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    assert datas[-1]["response"]["usage"]["output_tokens"] <= 3


def _scripted(live_app, make_engine, tiny, replies):
    from ktransformers.generation import Generator

    model, tok = tiny
    gen = ScriptedGenerator(Generator(model, tok), replies)
    return gen, live_app(make_engine(gen))


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(live_app, make_engine, tiny, stream):
    calls = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    gen, ctx = _scripted(live_app, make_engine, tiny, [calls, "Sunny in both."])
    with ctx as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=MODEL_NAME, input="Weather in Paris and Rome?", tools=[TOOL])
        if stream:
            types, arg_deltas = [], []
            with c.responses.stream(**kw) as s:
                for ev in s:
                    types.append(ev.type)
                    if ev.type == "response.function_call_arguments.delta":
                        arg_deltas.append(ev.delta)
                r = s.get_final_response()
            assert types.count("response.function_call_arguments.done") == 2
            assert [json.loads(a) for a in arg_deltas] == [{"city": "Paris"}, {"city": "Rome"}]
            assert "response.output_text.delta" not in types  # only whitespace between the calls
        else:
            r = c.responses.create(**kw)
        fcs = [o for o in r.output if o.type == "function_call"]
        assert [json.loads(f.arguments) for f in fcs] == [{"city": "Paris"}, {"city": "Rome"}]
        assert all(f.name == "get_weather" and f.call_id.startswith("call_") for f in fcs)
        assert "get_weather" in gen.prompts[0]  # the tool was described to the model
        outputs = [{"type": "function_call_output", "call_id": f.call_id, "output": '{"sky": "sunny"}'}
                   for f in fcs]
        r2 = c.responses.create(model=MODEL_NAME, previous_response_id=r.id, input=outputs, tools=[TOOL])
        assert r2.output_text == "Sunny in both."
        assert '"city": "Rome"' in gen.prompts[1] and gen.prompts[1].count('{"sky": "sunny"}') == 2
        assert "Weather in Paris and Rome?" in gen.prompts[1]


def test_parallel_tool_calls_off_and_malformed_call(live_app, make_engine, tiny):
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>')
    gen, ctx = _scripted(live_app, make_engine, tiny, [two, "<tool_call>{broken</tool_call>"])
    with ctx as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = c.responses.create(model=MODEL_NAME, input="w?", tools=[TOOL], parallel_tool_calls=False,
                               tool_choice={"type": "function", "name": "get_weather"})
        assert [o.type for o in r.output] == ["function_call"]
        assert "You must call the function 'get_weather'" in gen.prompts[0]
        bad = c.responses.create(model=MODEL_NAME, input="w?", tools=[TOOL])
        assert bad.status == "completed" and bad.output_text == "<tool_call>{broken</tool_call>"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_split(live_app, make_engine, tiny, stream):
    gen, ctx = _scripted(live_app, make_engine, tiny, ["<think>\nThe user greets me.\n</think>\n\nHello!"] * 2)
    with ctx as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        if stream:
            reasoning = ""
            with c.responses.stream(model=MODEL_NAME, input="Hi") as s:
                for ev in s:
                    if ev.type == "response.reasoning_text.delta":
                        reasoning += ev.delta
                r = s.get_final_response()
            assert reasoning == "The user greets me."
        else:
            r = c.responses.create(model=MODEL_NAME, input="Hi")
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "The user greets me."
        assert r.output_text == "Hello!"
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        # reasoning is not sent back to the model on the next turn
        c.responses.create(model=MODEL_NAME, input="again", previous_response_id=r.id)
        assert "The user greets me." not in gen.prompts[1] and "Hello!" in gen.prompts[1]


def test_background_and_cancel(live_app, make_engine, tiny):
    from ktransformers.generation import Generator

    from .test_engine import SlowGenerator, _wait

    model, tok = tiny
    slow = SlowGenerator(Generator(model, tok), delay=0.05)
    with live_app(make_engine(slow)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = c.responses.create(model=MODEL_NAME, input="go", background=True, max_output_tokens=500)
        assert r.status == "queued" and r.background
        assert _wait(lambda: c.responses.retrieve(r.id).status == "in_progress")
        done = c.responses.cancel(r.id)
        assert done.status == "cancelled" and slow.cancelled.is_set()
        quick = c.responses.create(model=MODEL_NAME, input="go", background=True, max_output_tokens=3)
        assert _wait(lambda: c.responses.retrieve(quick.id).status in ("completed", "incomplete"))
        with pytest.raises(openai.BadRequestError):
            c.responses.cancel(c.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2).id)


@pytest.mark.parametrize("body, where", [
    ({"input": 5}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "x", "background": True, "store": False}, "store"),
    ({"input": "x", "conversation": "conv_a", "previous_response_id": "resp_b"}, "previous_response_id"),
    ({}, "input"),
    ({"input": "x", "conversation": 5}, "conversation"),
    ({"input": "x", "tool_choice": "bogus"}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),  # no tools to require
    ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
])
def test_bad_bodies_are_400(http, body, where):
    r = http.post("/v1/responses", json={"model": MODEL_NAME, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == where


def test_not_found_shapes(http):
    for method, path in (("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
                         ("GET", "/v1/responses/resp_x/input_items"), ("POST", "/v1/responses/resp_x/cancel")):
        r = http.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    r = http.post("/v1/responses", json={"model": "gpt-9", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/responses", json={"input": "x", "conversation": "conv_nope"})
    assert r.status_code == 404


def test_stream_disconnect_cancels_and_keeps_partial(live_app, make_engine, tiny):
    from ktransformers.generation import Generator

    from .test_engine import SlowGenerator, _wait

    model, tok = tiny
    slow = SlowGenerator(Generator(model, tok), delay=0.05)
    with live_app(make_engine(slow)) as srv:
        body = {"model": MODEL_NAME, "input": "go", "stream": True, "max_output_tokens": 500}
        rid = None
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            with h.stream("POST", "/v1/responses", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and rid is None:
                        rid = json.loads(line[6:])["response"]["id"]
                    if "response.output_text.delta" in line:
                        break
        assert _wait(lambda: slow.cancelled.is_set())
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert _wait(lambda: c.responses.retrieve(rid).status == "cancelled")
        got = c.responses.retrieve(rid)
        assert got.output[0].status == "incomplete" and got.output[0].content[0].text
        # the engine is free again
        assert c.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2).status in ("completed",
                                                                                               "incomplete")
