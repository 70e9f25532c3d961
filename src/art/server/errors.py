"""Errors as the server answers them: OpenAI's shape `{"error": {message, type, param, code}}`.

The library's own errors are mapped by `art.errors.WIRE` (`to_wire`), the one table that
`art.RemoteBackend` also reads back (`from_wire`). Any other failure is logged here with a
request id and answered with only that id: no exception text leaves the server. Pydantic's
validation errors become a 400 that names the field.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from art.errors import ArtError, to_wire
from art.naming import echo

log = logging.getLogger(__name__)


class AsciiJSONResponse(JSONResponse):
    """Error bodies as ASCII JSON: no text a request sent (a lone surrogate) can break them."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode()


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return AsciiJSONResponse(body, status_code=status)


def error_response(body: dict[str, Any]) -> JSONResponse:
    """An `error_object` as the response (its `status` becomes the HTTP status, its
    `retry_after` a Retry-After header)."""
    status = body.pop("status")
    headers = {"Retry-After": str(body["retry_after"])} if body.get("retry_after") is not None else None
    return AsciiJSONResponse({"error": body}, status_code=status, headers=headers)


def internal_error(exc: BaseException, what: str = "request") -> dict[str, Any]:
    """The error object of an unexpected failure: no exception text leaves the server. Its
    `request_id` is the one on the server's log line, which has the traceback."""
    request_id = uuid.uuid4().hex[:16]
    log.error("%s failed [request_id %s]: %s: %s", what, request_id, type(exc).__name__, exc, exc_info=exc)
    return {
        "message": f"internal error (request_id {request_id}): the server's log has the details",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
        "request_id": request_id,
        "status": 500,
    }


def error_object(exc: BaseException, what: str = "request") -> dict[str, Any]:
    """OpenAI's error object for `exc`, with the HTTP `status` it is answered with
    (`art.errors.to_wire`). A 500 carries the library's own message, written for the user, and a
    `request_id` for the log line; failures that are not the library's own errors are logged
    with a request id and answered with only that id."""
    if not isinstance(exc, ArtError):
        return internal_error(exc, what)
    body = to_wire(exc)
    if body["status"] == 500:
        request_id = uuid.uuid4().hex[:16]
        log.error("%s failed [request_id %s]: %s", what, request_id, exc)
        body["request_id"] = request_id
    return body


def stream_error_event(exc: BaseException, what: str) -> str:
    """The SSE line that ends a stream whose sampling failed after its 200 left: the error
    object without its HTTP status, as vLLM ends a failed stream."""
    error = error_object(exc, what)
    error.pop("status")
    return f"data: {json.dumps({'error': error})}\n\n"


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
"""HTTP status -> Anthropic's error `type` (any other 4xx: invalid_request_error, 5xx: api_error)."""
ANTHROPIC_PATH = "/v1/messages"
"""Routes under this path answer errors in Anthropic's shape (the `anthropic` SDK reads them)."""


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body `{"type": "error", "error": {type, message}}` for an HTTP status."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def as_anthropic(response: Any) -> Any:
    """An error response in OpenAI's shape rewritten in Anthropic's (same status, Retry-After
    kept); the field OpenAI's `param` names leads the message. Any other response passes."""
    if not isinstance(response, JSONResponse) or response.status_code < 400:
        return response
    error = json.loads(bytes(response.body)).get("error") or {}
    message, param = str(error.get("message") or "error"), error.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    return AsciiJSONResponse(
        anthropic_error(response.status_code, message), status_code=response.status_code, headers=headers or None
    )


def _loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; ('query', 'x') -> 'x'."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure of `app`'s routes in OpenAI's error shape (Anthropic's under
    `ANTHROPIC_PATH`)."""

    def shaped(handler):
        async def answer(request: Request, exc: Exception) -> JSONResponse:
            response = await handler(request, exc)
            return as_anthropic(response) if request.url.path.startswith(ANTHROPIC_PATH) else response

        return answer

    @app.exception_handler(RequestValidationError)
    @shaped
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            ctx = (detail.get("ctx") or {}).get("error", "")
            return _error(
                400, f"malformed JSON body: {ctx}".rstrip(": "), "invalid_request_error", None, "invalid_json"
            )
        if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        parts = []
        for e in errors[:5]:
            where = _loc(tuple(e.get("loc", ()))) or "body"
            value = e.get("input")
            got = f" (got {echo(value)})" if isinstance(value, (int, float, str, bool)) else ""
            parts.append(f"{where}: {e.get('msg', 'invalid')}{got}")
        param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
        return _error(400, "invalid request: " + "; ".join(parts), "invalid_request_error", param)

    @app.exception_handler(ArtError)
    @shaped
    async def art_error(request: Request, exc: ArtError) -> JSONResponse:
        return error_response(error_object(exc, f"{request.method} {request.url.path}"))

    @app.exception_handler(StarletteHTTPException)
    @shaped
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    @shaped
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A backstop: Starlette still re-raises to the ASGI server after this response; the
        # routes themselves answer their own failures without re-raising.
        return error_response(internal_error(exc, f"{request.method} {request.url.path}"))
