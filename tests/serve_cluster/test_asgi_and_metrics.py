"""Driving an app in-process (what a replica does with the server's app) and the router's merged /metrics."""

from __future__ import annotations

import asyncio

from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from ktransformers.serve_cluster.asgi_call import ForwardedRequest, ResponseStart, call_asgi
from ktransformers.serve_cluster.metrics import merge_replica_metrics


def _app(events: list):
    async def slow(request):
        body = await request.body()

        async def gen():
            try:
                for i in range(1000):
                    yield f"{body.decode()}{i}\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                events.append("stopped")
        return StreamingResponse(gen(), media_type="application/x-ndjson", headers={"x-a": "1"})

    return Starlette(routes=[Route("/s", slow, methods=["POST"])])


def test_chunks_arrive_as_sent_and_closing_stops_the_app():
    events: list = []

    async def main():
        it = call_asgi(_app(events), ForwardedRequest("POST", "/s", body=b"x"))
        start = await it.__anext__()
        first = await it.__anext__()
        await it.aclose()  # the client went away after one chunk
        await asyncio.sleep(0.05)
        return start, first

    start, first = asyncio.run(main())
    assert isinstance(start, ResponseStart) and start.status == 200 and (b"x-a", b"1") in start.headers
    assert first == b"x0\n"  # streamed: not held until the body ends
    assert events == ["stopped"]


def test_a_whole_response_ends_the_iteration():
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/j")
    async def j(q: int):
        return {"q": q}

    async def main():
        return [x async for x in call_asgi(app, ForwardedRequest("GET", "/j", query=b"q=3"))]

    items = asyncio.run(main())
    assert items[0].status == 200 and b"".join(items[1:]) == b'{"q":3}'


def test_metrics_of_each_replica_under_its_label():
    from ktransformers.server.metrics import ServerMetrics

    a, b = ServerMetrics(), ServerMetrics()
    a.record_tokens(5)
    a.record_first_token(0.2)
    b.record_tokens(2)
    text = merge_replica_metrics({"replica-0": a.render().decode(), "replica-1": b.render().decode()}).decode()
    assert 'ktransformers_generated_tokens_total{replica="replica-0"} 5.0' in text
    assert 'ktransformers_generated_tokens_total{replica="replica-1"} 2.0' in text
    assert 'ktransformers_time_to_first_token_seconds_bucket{le="0.25",replica="replica-0"} 1.0' in text
    assert text.count("# TYPE ktransformers_generated_tokens_total counter") == 1  # one family, two series
