"""What stands between the network and the routes: a bearer key, request-size bounds, no
credentials in URLs, and which server paths a `base_model` may name.

The middleware is plain ASGI, so it covers every route (OpenAI and management alike, and
unknown paths) before FastAPI parses anything, and never buffers a response (the train route
streams). It answers in OpenAI's error shape. The key is compared in constant time and never
logged or echoed: a key put in a URL's query string is refused (URLs end up in access logs,
proxies and shell history), and the access log redacts such parameters anyway. A browser,
which cannot send the header, logs in to /dashboard with a form and a cookie that opens
/dashboard only (`art.dashboard.login`, handed to `BearerAuth` by `art.serve`).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from art.errors import ArtValueError

OPEN_PATHS = frozenset({"/health"})
"""Reachable without a key: liveness checks and load balancers must not need a secret."""


async def _send_error(send, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


CREDENTIAL_PARAMS = frozenset(
    {
        "api_key",
        "apikey",
        "api-key",
        "key",
        "token",
        "access_token",
        "auth",
        "authorization",
        "password",
        "secret",
        "bearer",
    }
)
_CREDENTIAL_IN_QUERY = re.compile(
    r"(?i)([?&](?:" + "|".join(re.escape(p) for p in sorted(CREDENTIAL_PARAMS)) + r")=)[^&#\s]*"
)


def redact_query(path: str) -> str:
    """`/v1/models?api_key=secret&x=1` -> `/v1/models?api_key=***&x=1`."""
    return _CREDENTIAL_IN_QUERY.sub(r"\1***", path)


class RedactCredentials(logging.Filter):
    """On uvicorn's access logger: credential query parameters never reach a log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


def redact_access_log() -> None:
    """Install `RedactCredentials` on uvicorn's access logger (once)."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactCredentials) for f in logger.filters):
        logger.addFilter(RedactCredentials())


class RefuseQueryCredentials:
    """400 for a request whose query string carries a credential-like parameter (`?api_key=`)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("query_string"):
            names = {k.lower() for k, _ in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)}
            if names & CREDENTIAL_PARAMS:
                await _send_error(
                    send,
                    400,
                    "credentials in the URL are refused (URLs are logged and shared): send "
                    "the key as `Authorization: Bearer <key>`",
                    "credentials_in_url",
                )
                return
        await self.app(scope, receive, send)


class BearerAuth:
    """Require `Authorization: Bearer <api_key>` (or Anthropic's `x-api-key: <api_key>`) on every
    HTTP request except `OPEN_PATHS` and `open_paths` (a login form must be postable by someone
    without the key). Those learn whether the caller had the key (`scope["state"]["authorized"]`:
    /health shows details only then).

    A browser cannot send the header: `session(scope)` says whether a request without it is let
    in anyway (the dashboard's login cookie), and `login_form(scope)` gives the ASGI app that
    answers it instead of the JSON 401 (the login form), or None.
    """

    def __init__(
        self,
        app,
        *,
        api_key: str,
        open_paths: frozenset[str] = frozenset(),
        session: Callable[[dict[str, Any]], bool] | None = None,
        login_form: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("BearerAuth needs a non-empty api_key")
        self.app = app
        self._expected = api_key.encode()
        self._open_paths = OPEN_PATHS | open_paths
        self._session = session
        self._login_form = login_form

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if not header:  # the `anthropic` SDK sends its key as `x-api-key`
            header = token = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
            scheme = b"bearer"
        # compare_digest on bytes: constant time whatever the token holds.
        authorized = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)
        if authorized or scope["path"] in self._open_paths:
            scope.setdefault("state", {})["authorized"] = authorized
            await self.app(scope, receive, send)
            return
        if self._session is not None and self._session(scope):
            await self.app(scope, receive, send)
            return
        form = self._login_form(scope) if self._login_form is not None else None
        if form is not None:
            await form(scope, receive, send)
            return
        message = (
            "Incorrect API key provided."
            if header
            else "Missing API key: send `Authorization: Bearer <key>` (art.RemoteBackend(api_key=...) "
            "or the ART_API_KEY environment variable)."
        )
        await _send_error(send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")])


class BodyLimit:
    """Answer 413 to request bodies larger than the bound, declared or streamed: `max_bytes`,
    or the bound of the first `path_limits` prefix the path starts with (chat requests get a
    smaller one than trajectory uploads).

    The body is read here (at most the bound of it) and replayed to the app, which would
    read it whole anyway to parse the JSON; a declared Content-Length over the bound is
    refused before anything is read.
    """

    def __init__(self, app, *, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = next((n for prefix, n in self.path_limits.items() if scope["path"].startswith(prefix)), self.max_bytes)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(send, limit)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._too_large(send, limit)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: wait for the disconnect, as the app expects

        await self.app(scope, replay, send)

    async def _too_large(self, send, limit: int) -> None:
        await _send_error(
            send,
            413,
            f"request body larger than {limit / 2**20:g} MiB; start the server with a "
            "larger --max-body-mb (trajectory uploads) or --max-chat-body-mb (chat requests), or send "
            "less per call",
            "request_too_large",
        )


def default_model_roots(models_dirs: Sequence[str] = ()) -> list[Path]:
    """Server folders a `base_model` path may point into: `--models-dir`s, the Hugging Face
    cache and art's cache (the bundled default model)."""
    from art.base_models import cache_root

    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub"
    )
    roots: list[str | Path] = [*models_dirs, hub, cache_root()]
    return [Path(p).expanduser().resolve() for p in roots]


def check_base_model(value: str, roots: list[Path] | None) -> None:
    """Refuse a `base_model` that names a server path outside `roots` (None: any path). A Hugging
    Face id ("org/name") is not a path unless such a folder exists; the answer is the same for a
    path that exists and one that does not, so it reveals nothing about the server's files. A
    value no file can be named (too long for the file system, a NUL byte, `~` of an unknown
    user) is judged the same way, never a 500."""
    if roots is None:
        return
    if value.startswith(("/", ".", "~", "\\")) or value.count("/") > 1 or _exists(value):
        real = _resolved(value)
        if real is None or not any(real == root or root in real.parents for root in roots):
            raise ArtValueError(
                "base_model names a path on the server outside the folders models may be loaded "
                "from (--models-dir, the Hugging Face cache, art's cache); use a Hugging Face id, put "
                "the model under a --models-dir, or start the server with --allow-any-model-path",
                field="base_model",
            )


def _exists(value: str) -> bool:
    """Whether a file is named `value`; False for a name none can have."""
    try:
        return Path(value).expanduser().exists()
    except (OSError, ValueError, RuntimeError):  # RuntimeError: `~name` of an unknown user
        return False


def _resolved(value: str) -> Path | None:
    """The absolute path `value` names, or None for a name no file can have."""
    try:
        return Path(value).expanduser().resolve()
    except (OSError, ValueError, RuntimeError):
        return None
