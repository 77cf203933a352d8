"""The application factory: ``create_app(engine, settings)`` → a FastAPI app.

Tests build the app around an already loaded model this way; ``main.py`` does the same after
loading the model from the command-line paths.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from .db import Database
from .engine import Engine
from .errors import error_body, install_error_handlers
from .settings import Settings

log = logging.getLogger("ktransformers.server")
WEB_DIR = Path(__file__).with_name("web")


class GuardMiddleware:
    """API key and request-size checks, before any route or body parsing runs.

    * With an API key, every route except ``GET /health`` (and the static ``/web`` files,
      which hold no data; the page asks for the key) needs ``Authorization: Bearer <key>``.
    * Bodies above ``max_body_bytes`` are refused with 413, by Content-Length when given,
      else while the body streams in.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body = max_body_bytes

    @staticmethod
    async def _reply(send, path: str, status: int, message: str, headers: dict | None = None):
        import json

        body = json.dumps(error_body(path, status, message)).encode()
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
        auth = ""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                auth = v.decode("latin-1")
                break
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.api_key and not self._authorized(scope):
            return await self._reply(send, path, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                     {"WWW-Authenticate": "Bearer"})
        length = None
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    length = int(v)
                except ValueError:
                    return await self._reply(send, path, 400, "bad Content-Length header")
        if length is not None and length > self.max_body:
            return await self._reply(send, path, 413, f"request body is {length} bytes; this server accepts at most "
                                                      f"{self.max_body} bytes (--max_body_mb)")
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
    from . import assistants_api, ollama_api, openai_api, responses_api
    from .assistants_api import RunRegistry

    settings = settings or Settings()
    database = db or Database(settings.data_dir)
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
    app.state.db = database
    app.state.runs = RunRegistry()
    install_error_handlers(app)

    app.include_router(openai_api.router, prefix="/v1")
    app.include_router(assistants_api.router, prefix="/v1")
    responses_api.install(app)  # /v1/responses, /v1/conversations
    app.include_router(ollama_api.router, prefix="/api")

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": __version__, **engine.status()}

    @app.get("/", response_class=PlainTextResponse)
    async def root():
        return f"ktransformers {__version__} is running (OpenAI API: /v1, Ollama API: /api" + \
               (", web: /web)" if settings.web else ")")

    if settings.web:
        app.mount("/web", StaticFiles(directory=str(WEB_DIR), html=True), name="web")

    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    return app
