"""The application factory: ``create_app(engine, settings)`` → a FastAPI app.

Tests build the app around an already loaded model this way; ``main.py`` does the same after
loading the model from the command-line paths.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from .db import Database
from .engine import Engine
from .errors import InternalError, document_errors, error_body, install_error_handlers
from .settings import Settings

log = logging.getLogger("ktransformers.server")
WEB_DIR = Path(__file__).with_name("web")


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")
#: ``Sec-Fetch-Site`` values of a request a browser sent for another site's page; without an
#: ``Origin`` header there is no origin to hold against ``--cors_origins``, so these are refused
CROSS_SITE_FETCHES = ("cross-site", "same-site")


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return v.decode("latin-1")
    return None


def _host_name(host_header: str) -> str:
    """``Host`` header without the port (``[::1]:8080`` -> ``[::1]``)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[:h.index("]") + 1] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class GuardMiddleware:
    """Runs before any route or body parsing, and is the last resort for any error.

    * Every request gets an id (``X-Request-Id``); an exception nobody handled is logged with its
      traceback and answered 500 in the API's shape naming that id, so the client never sees a
      traceback and the keep-alive connection stays usable.
    * ``Host`` must be one of ``allowed_hosts`` (the loopback names, the bind address and
      ``--allowed_hosts``): a DNS-rebinding page cannot read the server through its own name.
    * A request without ``Host`` (HTTP/1.0 allows it) is refused while the Host check is on.
    * A state-changing request (POST/PUT/PATCH/DELETE) that a browser sends from another origin
      (``Origin`` header) is refused unless that origin is in ``--cors_origins``; so is one without
      ``Origin`` that the browser marks ``Sec-Fetch-Site: cross-site`` / ``same-site``.
    * With an API key, every route except ``GET /health`` (and the static ``/web`` files,
      which hold no data; the page asks for the key) needs ``Authorization: Bearer <key>``.
    * Bodies above ``max_body_bytes`` are refused with 413, by Content-Length when given,
      else while the body streams in.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int, allowed_hosts: set[str] | None = None,
                 cors_origins: set[str] = frozenset()):
        self.app = app
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.allowed_hosts = allowed_hosts  # None: any Host (bound to all interfaces, or '*')
        self.cors_origins = cors_origins

    @staticmethod
    async def _reply(send, path: str, status: int, message: str, headers: dict | None = None, **kw):
        import json

        body = json.dumps(error_body(path, status, message, **kw)).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        path, method = scope["path"], scope["method"]
        if path == "/health" and method in ("GET", "HEAD"):
            return True
        if (path == "/web" or path.startswith("/web/")) and method in ("GET", "HEAD"):
            return True
        if method == "OPTIONS":
            return True
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _refusal(self, scope) -> tuple[int, str, dict] | None:
        """(status, message, headers) when the request must not reach a route."""
        host = _header(scope, b"host")
        if self.allowed_hosts is not None and host is None:  # HTTP/1.0 may omit it; the check needs it
            return 400, (f"the request names no Host; this server answers requests for "
                         f"{', '.join(sorted(self.allowed_hosts))} (add names with --allowed_hosts)"), {}
        if self.allowed_hosts is not None and _host_name(host) not in self.allowed_hosts:
            return 403, (f"Host '{host}' is not served here (allowed: {', '.join(sorted(self.allowed_hosts))}; "
                         "add names with --allowed_hosts)"), {}
        origin = _header(scope, b"origin")
        if origin is not None and scope["method"] in STATE_CHANGING and origin not in self.cors_origins:
            same = host is not None and origin.lower() in (f"http://{host.lower()}", f"https://{host.lower()}")
            if not same:
                return 403, (f"cross-site request from Origin '{origin}' refused (allow an origin with "
                             "--cors_origins)"), {}
        fetch_site = (_header(scope, b"sec-fetch-site") or "").strip().lower()
        if origin is None and scope["method"] in STATE_CHANGING and fetch_site in CROSS_SITE_FETCHES:
            return 403, (f"cross-site request (Sec-Fetch-Site: {fetch_site}, no Origin) refused (a page "
                         "allowed by --cors_origins sends its Origin)"), {}
        if self.api_key and not self._authorized(scope):
            return 401, "missing or wrong API key: send 'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"}
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                return 400, "bad Content-Length header", {}
            if int(length) > self.max_body:
                return 413, (f"request body is {int(length)} bytes; this server accepts at most "
                             f"{self.max_body} bytes (--max_body_mb)"), {}
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        rid = "req_" + uuid.uuid4().hex[:20]
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                msg = dict(msg, headers=list(msg.get("headers", [])) + [(b"x-request-id", rid.encode())])
            await send(msg)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                status, message, headers = refusal
                return await self._reply(tracking_send, path, status, message, headers)
            await self._pass(scope, receive, tracking_send)
        except Exception:  # the last resort: log it, answer 500, keep the connection
            log.exception("unhandled error on %s %s (request id %s)", scope.get("method"), path, rid)
            if not started:
                err = InternalError(rid)
                await self._reply(tracking_send, path, 500, err.message, type=err.type, code=err.code)

    async def _pass(self, scope, receive, send):
        path = scope["path"]
        if scope["method"] in ("POST", "PUT", "PATCH"):
            scope = _json_content_type(scope)
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise _BodyTooLarge(self.max_body)
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge as e:
            if not started:
                await self._reply(send, path, 413, e.detail)


def _json_content_type(scope):
    """Bodies are JSON on every route; Ollama's own examples (curl -d) send no JSON content type."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
    ctype = next((v for k, v in scope.get("headers", []) if k == b"content-type"), b"")
    if b"json" in ctype.lower():
        return scope
    return dict(scope, headers=headers + [(b"content-type", b"application/json")])


class _BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive``; an HTTPException so FastAPI's body parsing passes it through."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds {limit} bytes (--max_body_mb)")


def create_app(engine: Engine, settings: Settings | None = None, *, db: Database | None = None) -> FastAPI:
    """A FastAPI app serving ``engine``: OpenAI + Assistants under /v1, Ollama under /api, web at /web."""
    from .. import __version__
    from . import assistants_api, embeddings_api, ollama_api, openai_api, responses_api
    from .assistants_api import RunRegistry

    settings = settings or Settings()
    database = db or Database(settings.data_dir, url=settings.database_url)
    expired = database.expire_unfinished_runs()
    if expired:
        log.warning("marked %d run(s) left unfinished by a previous server as failed", expired)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await app.state.runs.shutdown()
            await app.state.responses.shutdown()
            engine.shutdown()

    app = FastAPI(title="ktransformers", version=__version__, lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.engine = engine
    app.state.settings = settings
    keep = getattr(getattr(engine, "generator", None), "keep_special_tokens", None)
    if keep is not None:  # the markers the output parsers read survive detokenization
        from .prompting import output_markers

        keep(output_markers())
    app.state.db = database
    app.state.runs = RunRegistry()
    install_error_handlers(app)

    app.include_router(openai_api.router, prefix="/v1")
    app.include_router(embeddings_api.openai_router, prefix="/v1")
    app.include_router(embeddings_api.ollama_router, prefix="/api")
    app.include_router(assistants_api.router, prefix="/v1")
    responses_api.install(app)  # /v1/responses, /v1/conversations
    app.include_router(ollama_api.router, prefix="/api")

    @app.head("/health", operation_id="health_head")
    @app.get("/health", operation_id="health")
    async def health():
        return {"status": "ok", "version": __version__, **engine.status()}

    @app.get("/metrics", response_class=PlainTextResponse, operation_id="metrics")
    async def metrics():
        """Prometheus text format (see docs/server.md); needs the API key when one is set."""
        from .metrics import CONTENT_TYPE_LATEST, ServerMetrics

        m = getattr(engine, "metrics", None)
        if m is None:  # an engine that records nothing itself: its status() gauges only
            m = engine.metrics = ServerMetrics(engine)
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=PlainTextResponse)
    async def root():
        return f"ktransformers {__version__} is running (OpenAI API: /v1, Ollama API: /api" + \
               (", web: /web)" if settings.web else ")")

    if settings.web:
        app.mount("/web", StaticFiles(directory=str(WEB_DIR), html=True), name="web")

    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       allowed_hosts=settings.host_allow_list(), cors_origins=set(settings.cors_origin_list()))
    if settings.cors_origin_list():  # outermost, so that refusals carry CORS headers the page can read
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origin_list(), allow_credentials=False,
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "OpenAI-Beta"],
                           expose_headers=["X-Request-Id", "Retry-After"], max_age=600)

    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            from .schemas import document_model_limits

            schema = document_errors(get_openapi(title=app.title, version=app.version, routes=app.routes))
            app.openapi_schema = document_model_limits(schema, model_name=engine.model_name,
                                                       vocab_size=engine.vocab_size,
                                                       empty_prompt_has_tokens=bool(engine.encode("")),
                                                       embedding_size=engine.embedding_size)
        return app.openapi_schema

    app.openapi = openapi
    return app
