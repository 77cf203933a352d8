"""Bad input from a careless user or a hostile web page: a named 4xx (or a correct answer),
never a 500 traceback, and never a request a cross-site page or a rebound DNS name can drive."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat

import httpx
import pytest

from .conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def srv(live_app):
    with live_app() as s:
        yield s


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def _openai_400(r, needle: str):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"], err
    return err


def _post_raw(http, path, raw: str):
    """POST a JSON text as written (``\\ud800`` escapes survive, as from any client)."""
    return http.post(path, content=raw.encode(), headers={"content-type": "application/json"})


# ---- the last resort ---------------------------------------------------------------------

def _http11(sock, method: str, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the response head"
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers["content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:n]


def test_unexpected_exception_is_a_500_with_request_id_and_connection_stays_usable(live_app, make_engine, caplog):
    engine = make_engine()

    def broken(*a, **kw):
        raise ZeroDivisionError("division by zero deep inside")

    engine.encode = broken
    with live_app(engine) as s, socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        with caplog.at_level(logging.ERROR, logger="ktransformers.server"):
            for _ in range(3):  # the same keep-alive connection answers each time
                status, headers, body = _http11(sock, "POST", COMPLETIONS,
                                                json.dumps({"prompt": "x", "max_tokens": 1}).encode())
                err = json.loads(body)["error"]
                assert status == 500 and err["type"] == "server_error" and err["code"] == "internal_error"
                rid = headers["x-request-id"]
                assert rid in err["message"] and "ZeroDivisionError" not in err["message"]
            status, _, body = _http11(sock, "GET", "/health")
            assert status == 200 and json.loads(body)["status"] == "ok"
        assert "ZeroDivisionError: division by zero deep inside" in caplog.text and rid in caplog.text
        r = httpx.post(s.url + "/api/generate", json={"model": MODEL_NAME, "prompt": "x", "raw": True,
                                                      "stream": False})
        assert r.status_code == 500 and "request id" in r.json()["error"]  # Ollama's shape


def test_error_after_the_stream_started_ends_it_with_an_error_event(live_app, make_engine, tiny):
    from ktransformers.generation import Generator

    class FailsMidway(Generator):
        def stream(self, input_ids, params, cancel=None):
            it = super().stream(input_ids, params, cancel)
            yield next(it)
            raise MemoryError("out of memory in the middle")

    model, tok = tiny
    with live_app(make_engine(FailsMidway(model, tok, max_cache_len=2048))) as s:
        r = httpx.post(s.url + CHAT, json={"messages": HI, "stream": True, "max_tokens": 8}, timeout=60)
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "server_error"
        r = httpx.post(s.url + "/api/chat", json={"model": MODEL_NAME, "messages": HI,
                                                  "options": {"num_predict": 8}}, timeout=60)
        assert "generation failed" in json.loads(r.text.splitlines()[-1])["error"]


# ---- named 4xx for each input that used to crash ------------------------------------------

@pytest.mark.parametrize("prompt", [[999999], [-5], [2**40], [[1, 2], [3, 999999]]])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_token_ids_outside_vocabulary(http, prompt, stream):
    r = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 2, "stream": stream, "echo": True})
    err = _openai_400(r, "outside the vocabulary")
    assert err["param"] == "prompt"


def test_ollama_context_outside_vocabulary(http):
    r = http.post("/api/generate", json={"model": MODEL_NAME, "prompt": "x", "context": [1, 999999],
                                         "stream": False})
    assert r.status_code == 400 and "'context[1]': token id 999999 is outside the vocabulary" in r.json()["error"]


def test_tiny_temperature_samples_as_greedy(http):
    greedy = http.post(CHAT, json={"messages": HI, "max_tokens": 6, "temperature": 0}).json()
    tiny = http.post(CHAT, json={"messages": HI, "max_tokens": 6, "temperature": 1e-300}).json()
    assert tiny["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    r = http.post("/api/chat", json={"model": MODEL_NAME, "messages": HI, "stream": False,
                                     "options": {"temperature": 1e-300, "num_predict": 6}})
    assert r.status_code == 200 and r.json()["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_assistants_run_with_tiny_temperature_completes(http):
    a = http.post("/v1/assistants", json={"temperature": 1e-300}).json()
    t = http.post("/v1/threads", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    r = http.post(f"/v1/threads/{t['id']}/runs", json={"assistant_id": a["id"], "stream": True,
                                                       "max_completion_tokens": 4})
    assert "event: thread.run.completed" in r.text or "event: thread.run.incomplete" in r.text, r.text[-500:]


@pytest.mark.parametrize("stream", [False, True])
def test_seed_beyond_64_bits_is_taken_modulo_2_64(http, stream):
    def text(seed, path=CHAT):
        if path == CHAT:
            r = http.post(CHAT, json={"messages": HI, "seed": seed, "stream": stream, "temperature": 1.5,
                                      "max_tokens": 6})
        else:
            r = http.post(path, json={"model": MODEL_NAME, "prompt": "x", "stream": stream,
                                      "options": {"seed": seed, "temperature": 1.5, "num_predict": 6}})
        assert r.status_code == 200, r.text
        assert "error" not in r.text, r.text  # a stream has no error event either
        return r.text.replace(r.text.split('"created"')[0], "") if stream else (
            r.json()["choices"][0]["message"]["content"] if path == CHAT else r.json()["response"])

    if not stream:  # the same draws as the seed it is congruent to, whatever its size or sign
        assert text(18446744073709551616 + 7) == text(7) and text(-1) == text(2**64 - 1)
        assert text(2**64 + 3, "/api/generate") == text(3, "/api/generate")
    else:
        text(18446744073709551616)
        text(2**70, "/api/generate")


@pytest.mark.parametrize("path, raw", [
    (COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    (CHAT, '{"messages": [{"role": "user", "content": "a\\udfffb"}]}'),
    ("/v1/threads", '{"metadata": {"k": "\\ud800"}}'),
    ("/v1/threads", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
])
def test_lone_surrogates(http, path, raw):
    _openai_400(_post_raw(http, path, raw), "lone surrogate")


def test_lone_surrogate_ollama(http):
    r = _post_raw(http, "/api/generate", f'{{"model": "{MODEL_NAME}", "prompt": "a\\ud800b"}}')
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]


def test_infinite_numbers_are_refused(http):
    r = _post_raw(http, "/api/generate", f'{{"model": "{MODEL_NAME}", "prompt": "x", '
                                         '"options": {"temperature": Infinity}}')
    assert r.status_code == 400 and "temperature" in r.json()["error"]


@pytest.mark.parametrize("part, needle", [
    ({"type": "text", "text": 5}, "content[0].text' must be a string, not int"),
    ({"type": 7}, "content[0].type' must be a string"),
])
def test_wrong_part_types_in_thread_messages(http, part, needle):
    t = http.post("/v1/threads").json()
    _openai_400(http.post(f"/v1/threads/{t['id']}/messages", json={"role": "user", "content": [part]}), needle)
    _openai_400(http.post("/v1/threads", json={"messages": [{"role": "user", "content": [part]}]}), needle)
    _openai_400(http.post(CHAT, json={"messages": [{"role": "user", "content": [part]}]}), needle)


@pytest.mark.parametrize("metadata, needle", [
    ({f"k{i}": "v" for i in range(17)}, "at most 16 items"),
    ({"k" * 65: "v"}, "at most 64 characters"),
    ({"k": "v" * 513}, "at most 512 characters"),
    ({"k": 5}, "valid string"),
])
def test_metadata_limits(http, metadata, needle):
    _openai_400(http.post("/v1/threads", json={"metadata": metadata}), needle)
    _openai_400(http.post("/v1/assistants", json={"metadata": metadata}), needle)


def test_metadata_at_the_limits_is_kept(http):
    md = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert http.post("/v1/threads", json={"metadata": md}).json()["metadata"] == md


# ---- cross-site and DNS-rebinding ----------------------------------------------------------

def test_foreign_host_is_refused(srv, http):
    r = http.get("/v1/threads", headers={"Host": "evil.example"})
    assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
    r = http.get("/api/tags", headers={"Host": "evil.example:80"})
    assert r.status_code == 403 and isinstance(r.json()["error"], str)
    for host in ("localhost", f"localhost:{srv.port}", f"127.0.0.1:{srv.port}", "[::1]:80"):
        assert http.get("/v1/threads", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_flag(live_app):
    with live_app(allowed_hosts="chat.lan, box") as s:
        assert httpx.get(s.url + "/v1/models", headers={"Host": "chat.lan:10002"}).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers={"Host": "other.lan"}).status_code == 403


def test_cross_site_post_is_refused_and_changes_nothing(srv, http):
    before = len(http.get("/v1/threads").json()["data"])
    r = http.post("/v1/threads", content=b"{}", headers={"Origin": "http://evil.example",
                                                         "Content-Type": "text/plain"})
    assert r.status_code == 403 and "Origin 'http://evil.example'" in r.json()["error"]["message"]
    assert len(http.get("/v1/threads").json()["data"]) == before
    same = f"http://127.0.0.1:{srv.port}"  # the server's own /web page
    assert http.post("/v1/threads", json={}, headers={"Origin": same}).status_code == 200
    assert http.post("/v1/threads", json={}).status_code == 200  # curl, SDKs: no Origin


def test_cors_origins_flag(live_app):
    page = "http://localhost:3000"
    with live_app(cors_origins=page) as s:
        pre = httpx.options(s.url + "/v1/threads", headers={
            "Origin": page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == page
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = httpx.post(s.url + "/v1/threads", json={}, headers={"Origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.post(s.url + "/v1/threads", json={}, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_bad_cors_origin_flag(capsys, tiny_dir):
    from ktransformers.server.main import main

    assert main(["--model_path", str(tiny_dir), "--cors_origins", "localhost:3000"]) == 2
    assert "--cors_origins localhost:3000" in capsys.readouterr().err


# ---- keys, files, answers ------------------------------------------------------------------

def test_api_key_from_environment_and_file(tmp_path, tiny_dir, monkeypatch):
    from ktransformers.errors import ConfigError
    from ktransformers.server.main import parse_settings

    monkeypatch.setenv("KT_API_KEY", "env-key")
    assert parse_settings(["--model_path", str(tiny_dir)]).api_key == "env-key"
    f = tmp_path / "key"
    f.write_text("file-key\n")
    assert parse_settings(["--model_path", str(tiny_dir), "--api_key_file", str(f)]).api_key == "file-key"
    assert parse_settings(["--model_path", str(tiny_dir), "--api_key", "flag"]).api_key == "flag"
    with pytest.raises(ConfigError, match="--api_key_file .*missing"):
        parse_settings(["--model_path", str(tiny_dir), "--api_key_file", str(tmp_path / "missing")])


def test_api_key_guards_routes(live_app):
    with live_app(api_key="s3cret") as s:
        assert httpx.get(s.url + "/v1/threads").status_code == 401
        assert httpx.get(s.url + "/v1/threads", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_data_files_are_private(tmp_path, srv):
    from ktransformers.server.main import _setup_logging
    from ktransformers.server.settings import Settings

    db = srv.app.state.db.path
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    log_file = _setup_logging(Settings(data_dir=str(tmp_path / "d")))
    try:
        assert stat.S_IMODE(os.stat(log_file).st_mode) == 0o600
    finally:
        logging.getLogger("ktransformers").handlers[:] = []


def test_show_has_no_server_paths(live_app, make_engine, tmp_path):
    engine = make_engine()
    engine.model_info["path"] = str(tmp_path / "secret-folder" / "model.gguf")
    with live_app(engine) as s:
        r = httpx.post(s.url + "/api/show", json={"model": MODEL_NAME})
        assert r.status_code == 200 and "secret-folder" not in r.text and str(tmp_path) not in r.text


def test_head_health(http):
    r = http.head("/health")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"


def test_openapi_documents_every_status(http):
    from ktransformers.server.errors import ERROR_STATUSES

    doc = http.get("/openapi.json").json()
    assert doc["paths"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert "422" not in codes and set(ERROR_STATUSES) <= codes, (method, path, codes)
    shape = doc["paths"]["/api/generate"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert shape["properties"]["error"] == {"type": "string"}


def test_openapi_states_this_models_limits(http, srv):
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    ids = next(a for a in prompt if a.get("items", {}).get("type") == "integer")["items"]
    assert ids["minimum"] == 0 and ids["maximum"] == srv.engine.vocab_size - 1 and "x-kt-vocabulary" not in ids
    model = schemas["ChatCompletionRequest"]["properties"]["model"]["anyOf"][0]
    assert set(model["enum"]) == {MODEL_NAME, f"{MODEL_NAME}:latest", ""}
    assert set(schemas["OllamaChatRequest"]["properties"]["model"]["enum"]) == {MODEL_NAME, f"{MODEL_NAME}:latest"}
    streams = {p: set(doc["paths"][p]["post"]["responses"]["200"]["content"])
               for p in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/api/chat", "/api/generate")}
    assert streams["/v1/chat/completions"] == {"application/json", "text/event-stream"}, streams
    assert streams["/api/generate"] == {"application/json", "application/x-ndjson"}, streams


def test_vanishing_repetition_penalty_samples(http):
    """A penalty of 1e-300 divides the seen tokens' logits into +inf; they stay finite and likeliest."""
    for body in ({"prompt": "x y", "max_tokens": 4, "temperature": 0.7, "repetition_penalty": 1e-300, "top_p": 0.9},
                 {"prompt": "x y", "max_tokens": 4, "repetition_penalty": 1e300}):
        r = http.post(COMPLETIONS, json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def test_integral_numbers_beyond_64_bits_are_read_as_integers(http):
    r = http.post(CHAT, json={"messages": HI, "top_k": 1e30, "seed": 1.8e19, "temperature": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    _openai_400(http.post(CHAT, json={"messages": HI, "top_k": 2.5, "max_tokens": 2}), "top_k")
    _openai_400(http.post(CHAT, json={"messages": HI, "max_tokens": -1e30}), "max_tokens")


def test_unknown_list_cursor_is_a_404(http):
    for path in ("/v1/assistants", "/v1/threads", "/v1/responses/resp_none/input_items"):
        r = http.get(path, params={"after": "asst_nothere"})
        assert r.status_code == 404, (path, r.text)
    http.post("/v1/assistants", json={"model": MODEL_NAME})
    r = http.get("/v1/assistants", params={"after": "asst_nothere"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"


@pytest.mark.parametrize("body, needle", [
    ({"input": [{"type": "reasoning", "summary": 5}]}, "'input[0].summary' must be a list"),
    ({"input": [{"type": "reasoning", "content": "abc"}]}, "'input[0].content' must be a list"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
                                                                                  "function": "f"}}, "tool_choice"),
])
def test_responses_shapes_that_used_to_raise(http, body, needle):
    _openai_400(http.post("/v1/responses", json={**body, "max_output_tokens": 2}), needle)
