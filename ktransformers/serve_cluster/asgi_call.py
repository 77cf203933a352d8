"""One HTTP request through an ASGI app in this process, its response streamed as it is sent.

A replica serves the router's requests with the server's own app (``create_app``: the same
routes, schemas, guard and streaming as ``python -m ktransformers.server``); this drives it.
httpx's ``ASGITransport`` would too, but it holds the whole body until the app finishes, which
a token stream cannot wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator


@dataclass
class ForwardedRequest:
    """What the router hands a replica: the client's request as it arrived (picklable)."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass
class ResponseStart:
    """The first item of a forwarded response; bytes chunks of the body follow."""

    status: int
    headers: list[tuple[bytes, bytes]]


async def call_asgi(app, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Yield the response's start, then each body chunk as the app sends it.

    Closing the iterator early (the client went away) tells the app ``http.disconnect``, as a
    server would, so a streaming route stops its generation."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        await out.put(msg)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
             "root_path": "", "query_string": req.query, "headers": list(req.headers),
             "client": req.client, "server": ("127.0.0.1", 80)}
    done = object()

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            await out.put(done)

    task = asyncio.create_task(run())
    try:
        while True:
            msg = await out.get()
            if msg is done:
                await task  # re-raises what the app raised
                return
            if msg["type"] == "http.response.start":
                yield ResponseStart(msg["status"], [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])])
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    gone.set()
                    await task
                    return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)  # cancels the app's task if it does not stop
