"""HTTP errors, answered in the shape each API family's clients expect.

OpenAI routes (``/v1``): ``{"error": {"message", "type", "param", "code"}}``.
Ollama routes (``/api``): ``{"error": "message"}``.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "request_too_large",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_overloaded"}


class APIError(Exception):
    """An error a client caused or can act on; ``message`` is one line."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}


class UnknownCursor(APIError):
    """A list's ``after`` / ``before`` names no object of that list: a 404, as any unknown id."""

    def __init__(self, cursor: str, param: str):
        super().__init__(404, f"cursor '{cursor}' is not an id in this list", param=param)


class InternalError(APIError):
    """The last resort: an exception nobody expected; the client gets only the request id."""

    def __init__(self, request_id: str):
        super().__init__(500, f"internal server error (request id {request_id}); the server log has the details",
                         type="server_error", code="internal_error")
        self.request_id = request_id


def request_id(scope_or_request) -> str:
    """The id the guard middleware gave this request (also sent as the ``X-Request-Id`` header)."""
    scope = getattr(scope_or_request, "scope", scope_or_request)
    return (scope.get("state") or {}).get("request_id", "req_unknown")


def internal_error(scope_or_request) -> InternalError:
    return InternalError(request_id(scope_or_request))


def error_body(path: str, status: int, message: str, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    if path.startswith("/api/") or path == "/api":
        return {"error": message}
    return {"error": {"message": message, "type": type or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(request_path: str, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(request_path, err.status, err.message, err.type, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def _loc_name(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        ctx = e.get("ctx") or {}
        return f"request body is not valid JSON ({ctx.get('error', 'parse error')})", None
    name = _loc_name(e.get("loc", ()))
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if e.get("type") == "missing":
        text = f"'{name}' is required" if name else "request body is required"
    elif name:
        text = f"'{name}': {msg}"
    else:
        text = msg
    if len(errs) > 1:
        text += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    return text, name or None


def install_error_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return JSONResponse(error_body(request.url.path, 400, message, "invalid_request_error", param),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(request.url.path, exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))


# ---- the OpenAPI document: every status code the server sends, in each API's error shape -----

#: status -> when the server answers it (on any route; the guard middleware runs before routing)
ERROR_STATUSES = {
    "400": "invalid request: bad JSON, a wrong type or value (the message names the field), prompt too long, "
           "no Host header",
    "401": "missing or wrong API key (only with --api_key / KT_API_KEY / --api_key_file)",
    "403": "Host not allowed (--allowed_hosts) or a cross-site browser request (--cors_origins)",
    "404": "unknown model, object or route",
    "405": "method not allowed on this route",
    "413": "request body larger than --max_body_mb",
    "500": "internal error; the body names a request id to look up in the server log",
    "503": "queue full (Retry-After header) or shutting down",
}
#: ``responses=`` of a route that streams when the body asks for it (``stream: true``)
STREAMS_SSE = {200: {"description": "the answer; with `stream: true`, server-sent events: `data: {...}` "
                                    "(an error ends the stream as an `error` object), then `data: [DONE]`",
                     "content": {"text/event-stream": {"schema": {"anyOf": [{"type": "object"},
                                                                            {"const": "[DONE]"}]}}}}}
STREAMS_NDJSON = {200: {"description": "the answer; streamed (the default) as one JSON object per line",
                        "content": {"application/x-ndjson": {"schema": {"type": "object"}}}}}
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def document_errors(schema: dict) -> dict:
    """Replace FastAPI's default 422 (this server answers 400) with the statuses it really sends."""
    for path, ops in schema.get("paths", {}).items():
        body = _OLLAMA_ERROR if path.startswith("/api/") else _OPENAI_ERROR
        for op in ops.values():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            op["responses"].pop("422", None)
            for code, why in ERROR_STATUSES.items():
                op["responses"].setdefault(code, {"description": why,
                                                  "content": {"application/json": {"schema": body}}})
    schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
    schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
    return schema
