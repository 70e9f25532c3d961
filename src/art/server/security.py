"""What stands between the network and the routes: a bearer key and a request-size bound.

Both are plain ASGI middleware, so they cover every route (OpenAI and management alike, and
unknown paths) before FastAPI parses anything, and they never buffer a response (the train
route streams). They answer in OpenAI's error shape. The key is compared in constant time
and never logged or echoed.
"""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = frozenset({"/health"})
"""Reachable without a key: liveness checks and load balancers must not need a secret."""


async def _send_error(send, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BearerAuth:
    """Require `Authorization: Bearer <api_key>` on every HTTP request except `OPEN_PATHS`."""

    def __init__(self, app, *, api_key: str) -> None:
        if not api_key:
            raise ValueError("BearerAuth needs a non-empty api_key")
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest on bytes: constant time whatever the token holds.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected):
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided." if header else
                   "Missing API key: send `Authorization: Bearer <key>` (art.RemoteBackend(api_key=...) "
                   "or the ART_API_KEY environment variable).")
        await _send_error(send, 401, message, "invalid_api_key", [(b"www-authenticate", b"Bearer")])


class BodyLimit:
    """Answer 413 to request bodies larger than `max_bytes`, declared or streamed.

    The body is read here (at most `max_bytes` of it) and replayed to the app, which would
    read it whole anyway to parse the JSON; a declared Content-Length over the bound is
    refused before anything is read.
    """

    def __init__(self, app, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
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

    async def _too_large(self, send) -> None:
        mib = self.max_bytes / 2**20
        await _send_error(send, 413, f"request body larger than {mib:g} MiB; start the server with a "
                          "larger --max-body-mb, or send fewer trajectory groups per call", "request_too_large")
