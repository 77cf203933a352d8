"""Engine boundary: one generation at a time, cancel on disconnect, 503 when the queue is full."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from .conftest import MODEL_NAME


class SlowGenerator:
    """The real Generator, slowed down per token so a test can act mid-generation."""

    def __init__(self, real, delay=0.05):
        self.real, self.delay = real, delay
        self.cancelled = threading.Event()
        self.started = threading.Event()

    @property
    def last_stats(self):
        return self.real.last_stats

    def apply_chat_template(self, *a, **kw):
        return self.real.apply_chat_template(*a, **kw)

    def stream(self, input_ids, params, cancel=None):
        self.started.set()
        for ev in self.real.stream(input_ids, params, cancel):
            if ev.finish_reason == "cancelled":
                self.cancelled.set()
            yield ev
            time.sleep(self.delay)


@pytest.fixture
def slow(tiny):
    from ktransformers.generation import Generator

    model, tok = tiny
    return SlowGenerator(Generator(model, tok, max_cache_len=2048))


def _wait(pred, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("route", ["openai", "ollama"])
def test_disconnect_cancels_generation(live_app, make_engine, slow, route):
    with live_app(make_engine(slow)) as srv:
        if route == "openai":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 500, "stream": True}
        else:
            path, body = "/api/generate", {"model": MODEL_NAME, "prompt": "hi", "options": {"num_predict": 500}}
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", path, json=body) as r:
                it = r.iter_lines()
                got = [next(it) for _ in range(3)]
                assert any(got)
            # the connection is closed mid-stream: the engine stops within a few tokens
            assert _wait(slow.cancelled.is_set, 5), "generation was not cancelled"
            assert _wait(lambda: srv.engine.status()["cancelled"] == 1 and srv.engine.status()["running"] is None)
            t0 = time.time()
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2})
            assert r.status_code == 200 and time.time() - t0 < 3  # starts at once, not after 500 tokens


def test_non_stream_disconnect_cancels(live_app, make_engine, slow):
    with live_app(make_engine(slow)) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/chat/completions", timeout=0.5,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500})
        # the disconnect is noticed between tokens; allow for a loaded machine
        assert _wait(slow.cancelled.is_set, 15)


def test_queue_full_answers_503(live_app, make_engine, slow):
    engine = make_engine(slow, max_queue=1)
    with live_app(engine) as srv:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=30) as c1, httpx.Client(base_url=srv.url, timeout=30) as c2:
            with c1.stream("POST", "/v1/chat/completions", json=body) as running:
                lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
                next(lines)
                assert _wait(lambda: engine.status()["running"] is not None)
                with c2.stream("POST", "/v1/chat/completions", json=body) as waiting:
                    assert waiting.status_code == 200  # one may wait
                    assert _wait(lambda: engine.status()["waiting"] == 1)
                    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=5)
                    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
                    assert r.json()["error"]["code"] == "queue_full"
                    r = httpx.post(srv.url + "/api/generate", json={"model": MODEL_NAME, "prompt": "x"}, timeout=5)
                    assert r.status_code == 503 and "busy" in r.json()["error"]


def test_chunked_body_too_large(live_app):
    with live_app(max_body_mb=0.01) as srv:
        def body():
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(20):
                yield b"a" * 1024
            yield b'"}]}'
        r = httpx.post(srv.url + "/v1/chat/completions", content=body(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def test_api_key(live_app):
    with live_app(api_key="s3cret", web=True) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/api/tags").json() == {"error": r.json()["error"]["message"]}
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(srv.url + "/web/").status_code == 200  # static page (no data); it asks for the key
        import openai

        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                         max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_sampling_defaults_from_server(live_app, make_engine):
    engine = make_engine(max_new_tokens=3)
    with live_app(engine) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["usage"]["completion_tokens"] <= 3
        p = engine.make_params(__import__("ktransformers.server.engine", fromlist=["x"]).GenerationRequest(
            [1, 2], temperature=None, top_p=0.5))
        assert p.temperature == 0.0 and p.top_p == 0.5 and p.max_new_tokens == 3


def test_ndjson_lines_are_json(live_app):
    with live_app() as srv:
        r = httpx.post(srv.url + "/api/chat", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}],
                                                   "options": {"num_predict": 3}})
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert lines[-1]["done"] and all(not x["done"] for x in lines[:-1])
