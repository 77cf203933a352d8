"""Ollama-compatible routes through the official ``ollama`` client, and a Tabby-style sequence."""

from __future__ import annotations

import json

import pytest

from .conftest import MODEL_NAME

ollama = pytest.importorskip("ollama")


@pytest.fixture
def client(server):
    return ollama.Client(host=server.url, timeout=60)


def _check_timings(r):
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration > 0 and r.prompt_eval_duration > 0 and r.eval_duration >= 0
    assert r.total_duration >= r.prompt_eval_duration


def test_generate_non_stream(client):
    r = client.generate(model=MODEL_NAME, prompt="Why is the sky blue?", stream=False,
                        options={"num_predict": 5, "temperature": 0})
    assert isinstance(r.response, str) and r.response
    assert r.eval_count <= 5
    _check_timings(r)
    assert r.context and len(r.context) == r.prompt_eval_count + r.eval_count


def test_generate_stream(client):
    parts = list(client.generate(model=MODEL_NAME, prompt="Why is the sky blue?", stream=True,
                                 options={"num_predict": 5}))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    _check_timings(parts[-1])
    whole = client.generate(model=MODEL_NAME, prompt="Why is the sky blue?", options={"num_predict": 5})
    assert "".join(p.response for p in parts) == whole.response


def test_generate_options_are_used(client):
    kw = dict(model=MODEL_NAME, prompt="x", stream=False)
    a = client.generate(options={"num_predict": 8, "temperature": 1.5, "seed": 3}, **kw).response
    b = client.generate(options={"num_predict": 8, "temperature": 1.5, "seed": 3}, **kw).response
    c = {client.generate(options={"num_predict": 8, "temperature": 1.5, "seed": s}, **kw).response
         for s in (4, 5, 6)}
    assert a == b and len(c | {a}) > 1
    short = client.generate(options={"num_predict": 2}, **kw)
    assert short.eval_count <= 2


def test_chat(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    r = client.chat(model=MODEL_NAME, messages=msgs, options={"num_predict": 4})
    assert r.message.role == "assistant" and isinstance(r.message.content, str)
    _check_timings(r)
    parts = list(client.chat(model=MODEL_NAME, messages=msgs, stream=True, options={"num_predict": 4}))
    assert parts[-1].done and "".join(p.message.content for p in parts) == r.message.content


def test_list_show_ps_version(client, http):
    models = client.list().models
    assert [m.model for m in models] == [MODEL_NAME]
    assert models[0].details.family == "qwen3_moe"
    info = client.show(MODEL_NAME)
    assert "completion" in info.capabilities and "vision" not in info.capabilities  # a text model
    assert info.modelinfo["general.architecture"] == "qwen3_moe"
    assert client.ps().models[0].model == MODEL_NAME
    assert http.get("/api/version").json()["version"]
    # ":latest" names the same model
    assert client.show(MODEL_NAME + ":latest").details.family == "qwen3_moe"


def test_unknown_model_is_404(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="no-such-model", prompt="hi")
    assert e.value.status_code == 404 and "not found" in e.value.error


def test_tabby_sequence(http):
    """What Tabby's ollama/completion backend sends: tags, show, then generate with a template."""
    tags = http.get("/api/tags").json()
    name = tags["models"][0]["name"]
    assert name == MODEL_NAME
    assert http.post("/api/show", json={"model": name}).status_code == 200
    # raw prompt (Tabby formats the FIM prompt itself with its prompt_template)
    body = {"model": name, "prompt": "<PRE> def add(a, b): <SUF>\n <MID>", "raw": True, "stream": True,
            "options": {"num_predict": 6, "temperature": 0, "seed": 0}}
    with http.stream("POST", "/api/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] and "context" not in lines[-1]  # raw mode returns no context
    raw_text = "".join(x["response"] for x in lines)
    # Tabby's explicit template '{{ .Prompt }}' renders the prompt as is: same tokens, same answer
    tpl = http.post("/api/generate", json=dict(body, raw=False, stream=False, template="{{ .Prompt }}")).json()
    assert tpl["response"] == raw_text
    # prompt + suffix: the tiny tokenizer has no FIM tokens, so the documented fallback continues the prefix
    fim = http.post("/api/generate", json={"model": name, "prompt": "def add(a, b):", "suffix": "\n    return c",
                                           "stream": False, "options": {"num_predict": 6}}).json()
    plain = http.post("/api/generate", json={"model": name, "prompt": "def add(a, b):", "raw": True,
                                             "stream": False, "options": {"num_predict": 6}}).json()
    assert fim["done"] and fim["response"] == plain["response"]


def test_curl_style_body_without_content_type(server):
    import httpx

    r = httpx.post(server.url + "/api/generate", content=json.dumps(
        {"model": MODEL_NAME, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}),
        headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200 and r.json()["done"]


def test_empty_prompt_loads(http):
    r = http.post("/api/generate", json={"model": MODEL_NAME}).json()
    assert r["done"] and r["done_reason"] == "load"
    r = http.post("/api/chat", json={"model": MODEL_NAME, "messages": []}).json()
    assert r["done"] and r["done_reason"] == "load"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_calls(live_app, make_engine, tiny, stream):
    from ktransformers.generation import Generator

    from .test_openai import WEATHER_TOOL, ScriptedGenerator

    model, tok = tiny
    gen = ScriptedGenerator(Generator(model, tok),
                            ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'])
    with live_app(make_engine(gen)) as srv:
        c = ollama.Client(host=srv.url)
        msgs = [{"role": "user", "content": "Weather in Oslo?"}]
        if stream:
            calls = [tc for part in c.chat(model=MODEL_NAME, messages=msgs, tools=[WEATHER_TOOL], stream=True)
                     for tc in (part.message.tool_calls or [])]
        else:
            calls = c.chat(model=MODEL_NAME, messages=msgs, tools=[WEATHER_TOOL]).message.tool_calls
        assert len(calls) == 1
        assert calls[0].function.name == "get_weather" and calls[0].function.arguments == {"city": "Oslo"}
