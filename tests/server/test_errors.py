"""Bad input gets a 4xx with a message in the right shape, and the server keeps serving."""

from __future__ import annotations

import pytest

from .conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
OK_BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("body, needle", [
    (b'{"messages": [', "not valid JSON"),
    (b'[1, 2]', "valid dictionary"),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "role"),
    (b'{"messages": []}', "at least one message"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 3}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', "n > 1"),
    (b'{}', "'messages' is required"),
])
def test_bad_chat_requests(http, body, needle):
    err = _openai_error(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 400)
    assert needle in err["message"]
    assert err["type"] == "invalid_request_error"


def test_unknown_model(http):
    err = _openai_error(http.post(CHAT, json=dict(OK_BODY, model="gpt-9")), 404)
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]


def test_too_long_prompt(http):
    long = "word " * 1000  # the byte-level tiny tokenizer: ~5000 tokens > 2048
    err = _openai_error(http.post(CHAT, json=dict(OK_BODY, messages=[{"role": "user", "content": long}])), 400)
    # the context is already the model's own limit: no larger --cache_lens to suggest, the limit named
    assert "context" in err["message"] and "max_position_embeddings" in err["message"]
    assert "--cache_lens" not in err["message"]
    assert err["code"] == "context_length_exceeded"
    r = http.post("/api/generate", json={"model": MODEL_NAME, "prompt": long, "stream": False})
    assert r.status_code == 400 and "context" in r.json()["error"]


def test_body_too_large(http):
    r = http.post(CHAT, content=b'{"x": "' + b"a" * (17 * 1024 * 1024) + b'"}',
                  headers={"content-type": "application/json"})
    _openai_error(r, 413)


def test_ollama_errors(http):
    r = http.post("/api/chat", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": 5}]})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = http.post("/api/generate", json={"prompt": "hi"})
    assert r.status_code == 400 and "model" in r.json()["error"]
    r = http.post("/api/generate", json={"model": MODEL_NAME, "prompt": "x", "template": "{{ range .Messages }}"})
    assert r.status_code == 400 and "not supported" in r.json()["error"]
    r = http.post("/api/generate", json={"model": MODEL_NAME, "prompt": "x", "options": {"num_predict": "many"}})
    assert r.status_code == 400 and "num_predict" in r.json()["error"]


def test_unknown_route_and_method(http):
    _openai_error(http.get("/v1/nothing"), 404)
    _openai_error(http.get(CHAT), 405)


def test_still_serving_after_errors(http):
    for _ in range(3):
        http.post(CHAT, content=b"{", headers={"content-type": "application/json"})
    r = http.post(CHAT, json=OK_BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    assert http.get("/health").json()["status"] == "ok"
