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
