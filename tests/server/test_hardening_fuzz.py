"""Bad HTTP input, fuzzed: a body too long for the context is refused before it is tokenized; Ollama's
``num_predict`` keeps within the server's limit; stored items and thread messages hold text; a tool's
name follows OpenAI's rule; a request with no ``Host``, or one a browser marks cross-site without an
``Origin``, never reaches a route; an embeddings input is one of its four shapes. Each class answers
a named 4xx, never a 5xx or a stored object."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from fastapi.testclient import TestClient

from .conftest import MODEL_NAME

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

MAX_NEW = 4
FUZZ = fuzz_settings(60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
#: any JSON value (JSON has no infinities), for fields a client may fill with anything
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=8))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


@pytest.fixture(scope="module")
def engine(tiny):
    from ktransformers.generation import Generator
    from ktransformers.server.engine import Engine, SamplingDefaults

    model, tok = tiny
    return Engine(Generator(model, tok, max_cache_len=2048), tok, model_name=MODEL_NAME, max_context=2048,
                  defaults=SamplingDefaults(max_new_tokens=MAX_NEW))


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    from ktransformers.server import Settings, create_app

    app = create_app(engine, Settings(data_dir=str(tmp_path_factory.mktemp("fuzz-data"))))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c


def _err(r) -> str:
    e = r.json()["error"]
    return e if isinstance(e, str) else e["message"]


# ---- prompt text too long for the context: refused by length, not tokenized -------------------

class _CountingEncode:
    """Counts the tokenizer calls the generator gets (none must happen for a refused prompt)."""

    def __init__(self, engine, monkeypatch):
        self.calls = 0
        gen = engine.generator
        for name in ("encode", "apply_chat_template"):
            orig = getattr(gen, name)

            def counted(*a, _orig=orig, **kw):
                self.calls += 1
                return _orig(*a, **kw)

            monkeypatch.setattr(gen, name, counted)


def test_ten_megabyte_prompt_is_refused_before_tokenizing(client, engine, monkeypatch):
    counter = _CountingEncode(engine, monkeypatch)
    big = "hello world " * (10 * 2**20 // 12)  # 10 MiB of text, under the 16 MiB body limit
    for path, body in (("/v1/completions", {"prompt": big, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 1}),
                       ("/api/generate", {"model": MODEL_NAME, "prompt": big, "raw": True, "stream": False}),
                       ("/api/chat", {"model": MODEL_NAME, "messages": [{"role": "user", "content": big}],
                                      "stream": False})):
        t0 = time.perf_counter()
        r = client.post(path, json=body)
        n = re.search(r"prompt text is (\d+) characters", _err(r)) if r.status_code == 400 else None
        assert n and int(n.group(1)) >= len(big), (path, r.text[:300])
        assert time.perf_counter() - t0 < 10, path
    assert counter.calls == 0


def test_prompt_character_bound_is_a_true_bound(engine):
    """No text of ``n`` characters tokenizes to fewer than n / longest_token_chars tokens, so text the
    bound refuses could never have fit."""
    L = engine.longest_token_chars
    assert L > 0 and engine.max_prompt_chars == engine.max_context * L
    for text in ("a" * 5000, " " * 3000, "\n" * 999, "ab " * 2000, "ǅ🙂" * 500):
        assert len(engine.encode(text, add_special_tokens=False)) * L >= len(text)


@FUZZ
@given(text=st.text(max_size=300), repeat=st.integers(1, 200))
def test_fuzz_prompt_length_named_400_or_tokenized(client, engine, text, repeat):
    text = text * repeat
    assert len(engine.tokenizer.encode(text, add_special_tokens=False)) * engine.longest_token_chars >= len(text)
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert r.status_code in (200, 400), r.text[:300]
    if len(text) > engine.max_prompt_chars:
        assert "characters" in _err(r)
    elif r.status_code == 400:  # too many tokens, empty prompt, or a lone surrogate: named by the tokenizer's count
        assert re.search(r"tokens|empty|surrogate", _err(r)), _err(r)


# ---- Ollama num_predict: -1 / -2 bounded by the server, other negatives refused -------------

@pytest.mark.parametrize("n", [-1, -2])
def test_num_predict_until_limit_keeps_to_max_new_tokens(client, n):
    for path, body in (("/api/generate", {"prompt": "hi", "raw": True}),
                       ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={"model": MODEL_NAME, "stream": False, "options": {"num_predict": n}, **body})
        assert r.status_code == 200 and 1 <= r.json()["eval_count"] <= MAX_NEW, (path, r.text[:300])


@FUZZ
@given(n=st.integers(-(2**40), 2**40) | st.sampled_from([-2, -1, 0, 1, -58800]))
def test_fuzz_num_predict(client, engine, n):
    from ktransformers.server.ollama_api import _request
    from ktransformers.server.schemas import OllamaOptions

    ids = engine.encode("hi")
    if n < 1 and n not in (-1, -2):
        r = client.post("/api/generate", json={"model": MODEL_NAME, "prompt": "hi", "stream": False,
                                               "options": {"num_predict": n}})
        assert r.status_code == 400 and "options.num_predict" in _err(r), r.text
        return
    req = _request(engine, ids, OllamaOptions(num_predict=n), "fuzz")
    try:
        params = engine.make_params(req)
    except Exception as e:  # a count beyond the room the prompt leaves: the context error
        assert n > engine.max_context - len(ids) and getattr(e, "status", None) == 400, e
        return
    assert params.max_new_tokens == (MAX_NEW if n < 0 else n)


# ---- stored items and thread messages hold text ------------------------------------------------

def test_conversation_item_without_type_or_content_is_refused(client):
    for item, field in (({"type": {}, "content": None}, "items[0].type"),
                        ({"type": "message", "role": "user", "content": None}, "items[0].content"),
                        ({"role": "user"}, "items[0].content")):
        r = client.post("/v1/conversations", json={"items": [item]})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (item, r.text)
        conv = client.post("/v1/conversations", json={}).json()["id"]
        r = client.post(f"/v1/conversations/{conv}/items", json={"items": [item]})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (item, r.text)
        assert client.get(f"/v1/conversations/{conv}/items").json()["data"] == []


def test_thread_message_without_text_is_refused(client):
    thread = client.post("/v1/threads", json={}).json()["id"]
    for part in ({"type": "text", "text": {"value": None}}, {"type": "text", "text": None}, {"type": "text"},
                 {"type": "text", "text": {}}):
        r = client.post(f"/v1/threads/{thread}/messages", json={"role": "user", "content": [part]})
        assert r.status_code == 400 and "content[0].text" in _err(r), (part, r.text)
        r = client.post("/v1/threads", json={"messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 400 and "messages[0].content[0].text" in _err(r), (part, r.text)
    assert client.get(f"/v1/threads/{thread}/messages").json()["data"] == []


@FUZZ
@given(item=st.dictionaries(st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output"]),
                            JSON | st.sampled_from(["message", "user", "assistant", "function_call"]), max_size=5))
def test_fuzz_conversation_items(client, item):
    r = client.post("/v1/conversations", json={"items": [item]})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"].startswith("items[0]"), r.text
        return
    for stored in client.get(f"/v1/conversations/{r.json()['id']}/items").json()["data"]:
        if stored["type"] == "message":
            assert all(isinstance(p["text"], str) for p in stored["content"]), stored


@FUZZ
@given(text=JSON, kind=st.sampled_from(["text", "input_text", None]))
def test_fuzz_thread_message_parts(client, text, kind):
    part = {"text": text} if kind is None else {"type": kind, "text": text}
    r = client.post("/v1/threads", json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        msgs = client.get(f"/v1/threads/{r.json()['id']}/messages").json()["data"]
        assert all(isinstance(p["text"]["value"], str) for m in msgs for p in m["content"]), msgs
    else:
        assert "content" in r.json()["error"]["param"], r.text


# ---- tool names: OpenAI's ^[a-zA-Z0-9_-]{1,64}$ -------------------------------------------------

def test_ten_thousand_character_tool_name_is_refused_at_once(client):
    long = "a" * 10_000
    for path, body, param in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                      "tools": [{"type": "function", "function": {"name": long}}]},
             "tools[0].function.name"),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "tools": [{"type": "function", "name": long}]},
             "tools[0].name"),
            ("/api/chat", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                           "tools": [{"type": "function", "function": {"name": long}}]}, "tools[0].function.name")):
        t0 = time.perf_counter()
        r = client.post(path, json=body)
        assert r.status_code == 400 and param in _err(r) and "10000 characters" in _err(r), (path, r.text[:300])
        assert time.perf_counter() - t0 < 5


@FUZZ
@given(name=st.text(max_size=80) | st.text(alphabet="abcXYZ09_-", min_size=60, max_size=70))
def test_fuzz_tool_names(client, name):
    ok = re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name) is not None
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                  "tools": [{"type": "function", "function": {"name": name}}]})
    assert r.status_code == (200 if ok else 400), (name, r.text[:300])
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, "store": False,
                                           "tools": [{"type": "function", "name": name}]})
    assert r.status_code == (200 if ok else 400), (name, r.text[:300])


# ---- embeddings input: any JSON is a 400 naming 'input' or one unit vector per input ------------

@FUZZ
@given(inp=JSON | st.lists(st.integers(-3, 2**20), max_size=4) | st.lists(st.text(max_size=5), max_size=3)
       | st.lists(st.lists(st.integers(-1, 300), max_size=3), max_size=3))
def test_fuzz_embeddings_input(client, inp):
    import numpy as np

    r = client.post("/v1/embeddings", json={"input": inp})
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert (r.json()["error"]["param"] or "").startswith("input"), r.text[:300]
    else:
        data = r.json()["data"]
        assert len(data) == (1 if isinstance(inp, str) or isinstance(inp[0], int) else len(inp))
        for d in data:
            assert abs(np.linalg.norm(d["embedding"]) - 1) < 1e-5
    r = client.post("/api/embed", json={"model": MODEL_NAME, "input": inp})
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert "input" in _err(r), r.text[:300]


# ---- requests that must not reach a route: no Host, or cross-site without Origin ---------------

def test_http10_request_without_host_is_refused(live_app):
    with live_app() as s, socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.split()[1] == b"400", data[:300]
        assert "names no Host" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("site", ["cross-site", "same-site", "Cross-Site"])
def test_cross_site_fetch_without_origin_is_refused_and_changes_nothing(client, site):
    before = len(client.get("/v1/threads").json()["data"])
    r = client.post("/v1/threads", json={}, headers={"Sec-Fetch-Site": site})
    assert r.status_code == 403 and "Sec-Fetch-Site" in _err(r), r.text
    assert len(client.get("/v1/threads").json()["data"]) == before
    for ok in ("same-origin", "none"):  # the server's own page; a typed URL or a bookmark
        assert client.post("/v1/threads", json={}, headers={"Sec-Fetch-Site": ok}).status_code == 200


#: Host headers, and whether a server bound to loopback serves them
SERVED = {"127.0.0.1:1": True, "localhost": True, "[::1]": True, "[::1]:80": True, "evil.example": False, "": False}


@FUZZ
@given(method=st.sampled_from(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
       host=st.none() | st.sampled_from(list(SERVED)),
       origin=st.none() | st.sampled_from(["http://127.0.0.1:1", "http://evil.example", "null", ""]),
       site=st.none() | st.sampled_from(["cross-site", "same-site", "same-origin", "none", "CROSS-SITE", "x"]))
def test_fuzz_guard_host_origin_fetch_site(method, host, origin, site):
    from ktransformers.server.app import GuardMiddleware

    guard = GuardMiddleware(None, api_key=None, max_body_bytes=1 << 20,
                            allowed_hosts={"localhost", "127.0.0.1", "[::1]"})
    headers = [(k.encode(), v.encode()) for k, v in (("host", host), ("origin", origin), ("sec-fetch-site", site))
               if v is not None]
    refusal = guard._refusal({"type": "http", "method": method, "path": "/v1/threads", "headers": headers})
    changing = method in ("POST", "PUT", "PATCH", "DELETE")
    if host is None:
        assert refusal is not None and refusal[0] == 400
    elif not SERVED[host]:
        assert refusal is not None and refusal[0] == 403
    elif changing and origin is not None and origin != f"http://{host}":
        assert refusal is not None and refusal[0] == 403 and "Origin" in refusal[1]
    elif changing and origin is None and (site or "").lower() in ("cross-site", "same-site"):
        assert refusal is not None and refusal[0] == 403 and "Sec-Fetch-Site" in refusal[1]
    else:
        assert refusal is None, refusal
