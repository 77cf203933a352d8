"""The Ray Serve application: N replica deployments of the server behind one router deployment.

* ``replica-0`` … ``replica-{N-1}``: one deployment each (one Ray actor: a machine or a NUMA
  node's share, ``num_cpus`` / ``memory`` as its Ray resources), holding the engine that
  ``python -m ktransformers.server`` would build and the server's own app around it
  (:func:`~ktransformers.server.main.build_engine`, :func:`~ktransformers.server.app.create_app`).
  Ray restarts a replica whose process died (its controller's health check).
* ``router``: the HTTP ingress.  It reads a request's body, picks the replica with
  :class:`~.routing.AffinityPolicy` and streams that replica's response back unchanged.  A
  replica lost mid-stream ends the stream with the API's own error event; the router marks it
  down until it answers again, so new requests go to the live replicas.  ``GET /metrics`` is
  every replica's ``/metrics`` with a ``replica`` label.

Each replica is a deployment of its own, not one deployment of N replicas, because the router
must name the replica that holds a conversation's pages, and a Ray Serve handle picks a replica
of a deployment by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .asgi_call import ForwardedRequest, ResponseStart, call_asgi
from .routing import ID_SCAN_BYTES, AffinityPolicy, NoLiveReplica, ids_in_response, route_keys

log = logging.getLogger("ktransformers.serve_cluster")

#: seconds between the router's liveness probes of each replica, and a probe's deadline
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2.0
#: probes in a row a replica may miss (busy, restarting) before it is routed around; a replica
#: whose process is gone is routed around at once
PROBE_MISSES = 3
#: headers of a replica's response the router does not copy (it re-frames the body)
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}
#: the replica failures that mean its process is gone (as opposed to an error it answered)
REPLICA_LOST = (RayActorError, ActorUnavailableError)


def replica_name(i: int) -> str:
    return f"replica-{i}"


class Replica:
    """One copy of the model with the server's app; ``argv`` are ``python -m ktransformers.server`` flags."""

    def __init__(self, argv: list[str], name: str):
        from ..server.app import create_app
        from ..server.main import build_engine, parse_settings

        settings = parse_settings(argv)
        root = logging.getLogger("ktransformers")  # Ray keeps each replica's stderr in its logs
        root.setLevel(getattr(logging, settings.log_level.upper(), logging.INFO))
        if not root.handlers:
            root.addHandler(logging.StreamHandler())
        if not settings.database_url:  # each replica its own SQLite file; a shared store needs --database_url
            settings = settings.replace(data_dir=str(Path(settings.data_dir) / name))
        Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
        self.name = name
        self.engine = build_engine(settings)
        self.app = create_app(self.engine, settings)
        self._lifespan = None
        self._lock = asyncio.Lock()

    async def _started(self) -> None:
        """Run the app's lifespan start (the engine's worker) once, on the replica's event loop."""
        async with self._lock:
            if self._lifespan is None:
                cm = self.app.router.lifespan_context(self.app)
                await cm.__aenter__()
                self._lifespan = cm

    async def forward(self, req: ForwardedRequest):
        """The app's response to ``req``: a :class:`ResponseStart`, then the body's chunks."""
        await self._started()
        async for item in call_asgi(self.app, req):
            yield item

    async def info(self) -> dict:
        """Who this replica is (its process id, for operators and the fault tests) and its load."""
        status = self.engine.status()
        return {"name": self.name, "pid": os.getpid(), "running": status.get("running"),
                "waiting": status.get("waiting")}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class Router:
    """The HTTP ingress: routes each request to a replica by prefix affinity (see :mod:`.routing`)."""

    def __init__(self, replicas: dict, *, spill_at: int, max_body_bytes: int):
        self.handles = replicas
        self.policy = AffinityPolicy(list(replicas), spill_at=spill_at)
        self.max_body = max_body_bytes
        self._probe_task: asyncio.Task | None = None
        self._misses = dict.fromkeys(replicas, 0)

    # ---- liveness ---------------------------------------------------------------------
    def _ensure_probing(self) -> None:
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(name) for name in self.handles))
            await asyncio.sleep(PROBE_EVERY_S)

    async def _probe(self, name: str) -> None:
        try:
            await asyncio.wait_for(self.handles[name].info.remote(), PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, RayError) as e:
            self._misses[name] += 1
            if isinstance(e, REPLICA_LOST) or self._misses[name] >= PROBE_MISSES:
                if name not in self.policy.down:
                    log.warning("%s does not answer; routing around it until it does", name)
                self.policy.mark_down(name)
        else:
            self._misses[name] = 0
            if name in self.policy.down:
                log.info("%s is back", name)
            self.policy.mark_up(name)

    def _lost(self, name: str, err: BaseException) -> None:
        log.warning("%s failed (%s: %s); routing around it until it answers again", name,
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        self.policy.mark_down(name)

    # ---- requests ---------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        self._ensure_probing()
        from ..server.errors import error_body

        path = request.url.path
        body = await self._body(request)
        if body is None:
            return JSONResponse(error_body(path, 413, f"request body exceeds {self.max_body} bytes (--max_body_mb)"),
                                status_code=413)
        if path == "/metrics" and request.method == "GET":
            return await self._metrics(request)
        keys = route_keys(path, body)
        try:
            name = self.policy.choose(keys)
        except NoLiveReplica:
            return JSONResponse(error_body(path, 503, "no replica is up; retry in a few seconds"), status_code=503,
                                headers={"Retry-After": "2"})
        fwd = ForwardedRequest(request.method, path, request.url.query.encode(), list(request.headers.raw), body,
                               (request.client.host, request.client.port) if request.client else None)
        self.policy.started(name)
        stream = self.handles[name].options(stream=True).forward.remote(fwd)
        try:
            start = await stream.__anext__()
        except asyncio.CancelledError:  # the client left before the replica answered
            self.policy.finished(name)
            stream.cancel()
            raise
        except (RayError, StopAsyncIteration) as e:
            self.policy.finished(name)
            stream.cancel()
            if isinstance(e, REPLICA_LOST):
                self._lost(name, e)
            return JSONResponse(error_body(path, 503, f"{name} failed before answering; retry (new requests "
                                                      "go to a live replica)"),
                                status_code=503, headers={"Retry-After": "1"})
        media = next((v.decode("latin-1") for k, v in start.headers if k.lower() == b"content-type"), "")
        headers = [(k, v) for k, v in start.headers if k.lower() not in HOP_HEADERS]
        headers.append((b"x-served-by", name.encode()))
        if is_stream(media):
            if start.status < 400:
                self.policy.record(keys, name)
            resp = _RelayedResponse(_Relay(self, stream, name, path, media), status_code=start.status)
        else:  # a whole answer: sent only once it is whole, so a 200 always carries its body
            try:
                body = b"".join([chunk async for chunk in stream])
            except (RayError, asyncio.CancelledError) as e:
                stream.cancel()
                if isinstance(e, asyncio.CancelledError):
                    raise
                if isinstance(e, REPLICA_LOST):
                    self._lost(name, e)
                return JSONResponse(error_body(path, 503, f"{name} failed while answering; retry (new requests "
                                                          "go to a live replica)"),
                                    status_code=503, headers={"Retry-After": "1"})
            finally:
                self.policy.finished(name)
            if start.status < 400:
                self.policy.record(keys, name)
                self.policy.learn_ids(ids_in_response(body), name)
            resp = Response(body, status_code=start.status)
        resp.raw_headers = headers + ([(b"content-length", str(len(resp.body)).encode())]
                                      if not isinstance(resp, StreamingResponse) else [])
        return resp

    async def _body(self, request: Request) -> bytes | None:
        """The request body, or None past ``max_body`` (read no further than that)."""
        chunks, n = [], 0
        async for c in request.stream():
            n += len(c)
            if n > self.max_body:
                return None
            chunks.append(c)
        return b"".join(chunks)

    async def _metrics(self, request: Request) -> Response:
        """Every live replica's ``/metrics`` (each answered by its own app: same API key check),
        merged with a ``replica`` label; a replica's refusal (401) is answered as it is."""
        from .metrics import merge_replica_metrics

        fwd = ForwardedRequest("GET", "/metrics", b"", list(request.headers.raw), b"")

        async def scrape(name):
            status, chunks = None, []
            async for item in self.handles[name].options(stream=True).forward.remote(fwd):
                if isinstance(item, ResponseStart):
                    status = item.status
                else:
                    chunks.append(item)
            return status, b"".join(chunks)

        texts, refusal = {}, None
        for name in self.policy.live():
            try:
                status, body = await asyncio.wait_for(scrape(name), 10)
            except (asyncio.TimeoutError, RayError) as e:
                if isinstance(e, REPLICA_LOST):
                    self._lost(name, e)
                continue
            if status == 200:
                texts[name] = body.decode()
            elif refusal is None:
                refusal = Response(body, status_code=status, media_type="application/json")
        if refusal is not None and not texts:
            return refusal
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        up = "".join(f'ktransformers_cluster_replica_up{{replica="{n}"}} {int(n not in self.policy.down)}\n'
                     for n in self.handles)
        text = "# HELP ktransformers_cluster_replica_up 1 while the router routes to the replica\n" \
               "# TYPE ktransformers_cluster_replica_up gauge\n" + up
        return Response(merge_replica_metrics(texts) + text.encode(), media_type=CONTENT_TYPE_LATEST)


class _Relay:
    """A replica's body chunks on their way to the client; a replica lost on the way ends the
    body with an error event (:func:`stream_error_chunks`)."""

    def __init__(self, router: Router, stream, name: str, path: str, media: str):
        self.router, self.stream, self.name, self.path, self.media = router, stream, name, path, media
        self.complete = False

    async def chunks(self):
        head = b""
        try:
            async for chunk in self.stream:
                if len(head) < ID_SCAN_BYTES:
                    head += chunk
                    self.router.policy.learn_ids(ids_in_response(head), self.name)
                yield chunk
        except RayError as e:
            if isinstance(e, REPLICA_LOST):
                self.router._lost(self.name, e)
            else:
                log.error("%s: the stream of %s broke: %s", self.name, self.path, e)
            for c in stream_error_chunks(self.path, self.media, f"{self.name}, which was serving this stream, "
                                                                "failed; the answer is incomplete (retry: a live "
                                                                "replica takes it)"):
                yield c
        self.complete = True

    def close(self) -> None:
        """The response is over, however it ended: the replica's count goes down once, and its
        generation stops if the client left before the end."""
        self.router.policy.finished(self.name)
        if not self.complete:
            self.stream.cancel()


class _RelayedResponse(StreamingResponse):
    """Closes its relay when sending ends, also when it is cancelled before the body started
    (a client gone at once), which a generator's ``finally`` would never see."""

    def __init__(self, relay: _Relay, status_code: int):
        super().__init__(relay.chunks(), status_code=status_code)
        self.relay = relay

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.close()


def is_stream(media: str) -> bool:
    """Whether a response of this content type is a stream (SSE, NDJSON) the router relays as it comes."""
    media = media.lower()
    return "text/event-stream" in media or "ndjson" in media


def stream_error_chunks(path: str, media: str, message: str) -> list[bytes]:
    """The error that ends a stream, in the framing and shape of the API that started it:
    NDJSON ``{"error": …}`` (Ollama), an SSE ``error`` event (Responses), an SSE OpenAI error
    chunk and ``[DONE]`` (chat / completions); nothing for a whole answer (the router holds one
    until it is complete, and answers 503 when its replica is lost)."""
    from ..server.common import ndjson, sse
    from ..server.errors import error_body

    if not is_stream(media):
        return []
    if "ndjson" in media or path.startswith("/api/"):
        return [ndjson({"error": message}).encode()]
    if path.startswith("/v1/responses"):
        return [sse({"type": "error", "code": "replica_lost", "message": message, "param": None},
                    event="error").encode()]
    return [sse(error_body(path, 503, message, type="server_error", code="replica_lost")).encode(), sse("[DONE]").encode()]


def build_app(argv: list[str], *, replicas: int, replica_cpus: float, replica_memory_gb: float = 0.0,
              spill_at: int, max_body_bytes: int, health_check_period_s: float = 2.0):
    """The bound Ray Serve application (``serve.run`` it): ``replicas`` replica deployments and
    the router in front of them."""
    options = {"num_cpus": replica_cpus}
    if replica_memory_gb > 0:
        options["memory"] = int(replica_memory_gb * 2**30)
    replica = serve.deployment(Replica)
    bound = {}
    for i in range(replicas):
        name = replica_name(i)
        bound[name] = replica.options(name=name, num_replicas=1, ray_actor_options=options,
                                      max_ongoing_requests=1000, health_check_period_s=health_check_period_s,
                                      health_check_timeout_s=30, graceful_shutdown_timeout_s=5).bind(argv, name)
    router = serve.deployment(Router).options(name="router", num_replicas=1, ray_actor_options={"num_cpus": 0},
                                              max_ongoing_requests=10000)
    return router.bind(bound, spill_at=spill_at, max_body_bytes=max_body_bytes)
