"""The router's own decisions with stand-in replica handles (Ray imported, no cluster started)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the cluster extra: pip install 'ktransformers[cluster]')")
from ray.exceptions import ActorDiedError  # noqa: E402

from ktransformers.serve_cluster import deployments  # noqa: E402
from ktransformers.serve_cluster.deployments import PROBE_MISSES, Router, stream_error_chunks  # noqa: E402


class _Handle:
    """``handle.info.remote()`` as a replica answers it: at once, never, or with its death."""

    def __init__(self, mode: str):
        self.mode = mode
        self.info = self

    def remote(self):
        async def call():
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if self.mode == "dead":
                raise ActorDiedError()
            return {"pid": 1}
        return call()


def test_busy_replica_is_routed_around_only_after_missed_probes(monkeypatch):
    monkeypatch.setattr(deployments, "PROBE_TIMEOUT_S", 0.01)
    handles = {"replica-0": _Handle("hang"), "replica-1": _Handle("dead")}
    router = Router(handles, spill_at=4, max_body_bytes=1024)

    async def probes(n):
        for _ in range(n):
            await asyncio.gather(*(router._probe(name) for name in handles))

    asyncio.run(probes(1))
    assert router.policy.down == {"replica-1"}  # its process is gone: at once
    asyncio.run(probes(PROBE_MISSES - 1))
    assert router.policy.down == {"replica-0", "replica-1"}  # slow too many times in a row
    handles["replica-0"].mode = "ok"
    asyncio.run(probes(1))
    assert router.policy.down == {"replica-1"}


@pytest.mark.parametrize("path, media, first", [
    ("/v1/chat/completions", "text/event-stream; charset=utf-8", b'data: {"error": {"message": "gone"'),
    ("/v1/responses", "text/event-stream", b"event: error\ndata: {\"type\": \"error\""),
    ("/api/chat", "application/x-ndjson", b'{"error": "gone"}\n'),
    ("/v1/chat/completions", "application/json", None),
])
def test_the_error_that_ends_a_stream_speaks_its_api(path, media, first):
    chunks = stream_error_chunks(path, media, "gone")
    if first is None:
        assert chunks == []
    else:
        assert chunks[0].startswith(first)
        if path == "/v1/chat/completions":
            assert chunks[-1] == b"data: [DONE]\n\n"


class _Stream:
    """A replica's streamed answer as the router's handle returns it."""

    def __init__(self, items, fail_after: int | None = None):
        self.items, self.fail_after, self.cancelled = list(items), fail_after, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail_after is not None and self.fail_after == 0:
            raise ActorDiedError()
        if not self.items:
            raise StopAsyncIteration
        if self.fail_after is not None:
            self.fail_after -= 1
        return self.items.pop(0)

    def cancel(self):
        self.cancelled = True


class _StreamingHandle:
    def __init__(self, stream):
        self.stream, self.forward = stream, self

    def options(self, **kw):
        return self

    def remote(self, req):
        return self.stream


def _request(path: str, body: bytes):
    from starlette.requests import Request

    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"host", b"127.0.0.1")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "scheme": "http", "root_path": "", "http_version": "1.1"}
    return Request(scope, receive)


def _answer(router, path, body, send):
    async def main():
        router._ensure_probing = lambda: None
        resp = await router(_request(path, body))
        await resp({"type": "http", "asgi": {"spec_version": "2.4"}}, None, send)
        return resp
    return asyncio.run(main())


def test_a_replica_lost_mid_stream_ends_it_with_the_error_and_marks_it_down():
    from ktransformers.serve_cluster.asgi_call import ResponseStart

    stream = _Stream([ResponseStart(200, [(b"content-type", b"text/event-stream")]), b"data: 1\n\n"], fail_after=2)
    router = Router({"replica-0": _StreamingHandle(stream)}, spill_at=4, max_body_bytes=1024)
    out = []

    async def send(msg):
        out.append(msg)

    _answer(router, "/v1/chat/completions", b'{"messages": []}', send)
    body = b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")
    assert body.startswith(b"data: 1\n\n") and b'"code": "replica_lost"' in body and body.endswith(b"data: [DONE]\n\n")
    assert router.policy.down == {"replica-0"} and router.policy.in_flight == {"replica-0": 0}


def test_a_client_gone_before_the_body_releases_the_replica():
    from ktransformers.serve_cluster.asgi_call import ResponseStart

    stream = _Stream([ResponseStart(200, [(b"content-type", b"text/event-stream")]), b"data: 1\n\n"])
    router = Router({"replica-0": _StreamingHandle(stream)}, spill_at=4, max_body_bytes=1024)

    async def send(msg):  # the connection is gone: sending the start is cancelled
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        _answer(router, "/v1/chat/completions", b"{}", send)
    assert router.policy.in_flight == {"replica-0": 0} and stream.cancelled


def test_a_body_over_the_limit_is_refused_before_any_replica():
    router = Router({"replica-0": _StreamingHandle(_Stream([]))}, spill_at=4, max_body_bytes=10)
    out = []

    async def send(msg):
        out.append(msg)

    _answer(router, "/api/chat", b"x" * 11, send)
    assert out[0]["status"] == 413 and b"exceeds 10 bytes" in out[1]["body"]


def test_a_whole_answer_cut_by_a_lost_replica_is_a_503_not_a_short_200():
    from ktransformers.serve_cluster.asgi_call import ResponseStart

    stream = _Stream([ResponseStart(200, [(b"content-type", b"application/json")]), b'{"id": "conv_'],
                     fail_after=2)
    router = Router({"replica-0": _StreamingHandle(stream)}, spill_at=4, max_body_bytes=1024)
    out = []

    async def send(msg):
        out.append(msg)

    _answer(router, "/v1/conversations", b"{}", send)
    assert out[0]["status"] == 503 and b"replica-0 failed while answering" in out[1]["body"]
    assert router.policy.down == {"replica-0"} and router.policy.in_flight == {"replica-0": 0}


def test_a_whole_answer_teaches_the_router_its_ids():
    from ktransformers.serve_cluster.asgi_call import ResponseStart

    stream = _Stream([ResponseStart(200, [(b"content-type", b"application/json")]), b'{"id": "conv_0a1b", ',
                      b'"object": "conversation"}'])
    router = Router({"replica-0": _StreamingHandle(stream)}, spill_at=4, max_body_bytes=1024)
    out = []

    async def send(msg):
        out.append(msg)

    _answer(router, "/v1/conversations", b"{}", send)
    assert out[0]["status"] == 200 and out[1]["body"] == b'{"id": "conv_0a1b", "object": "conversation"}'
    assert (b"x-served-by", b"replica-0") in out[0]["headers"]
    assert (b"content-length", b"45") in out[0]["headers"]
    assert router.policy.ids["conv_0a1b"] == "replica-0"
