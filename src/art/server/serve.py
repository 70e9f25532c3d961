"""`art serve`: one process holding a `LocalBackend`, reachable over HTTP.

The app is the OpenAI routes (`art.server.app`) plus the management routes
(`art.server.management`), behind a bearer key and a request-size bound
(`art.server.security`). Unlike `LocalBackend`'s own loopback server, this one is meant to be
reached from other machines (the `art serve` command refuses a non-loopback address without a key).
A restarted server loads stored runs again when a request names them
(`management.Registrations`), and a watchdog thread (`art.server.watchdog`) reports a stuck
engine loop or training step in the log and on /health.
"""

from __future__ import annotations

import contextlib
import logging
import socket

from fastapi import FastAPI

from art.backends.local import LocalBackend
from art.server.app import create_app
from art.server.management import Registrations, management_router
from art.server.security import BearerAuth, BodyLimit
from art.server.thread import KEEP_ALIVE_S
from art.server.watchdog import ENGINE_STALL_S, TRAINING_STEP_S, Watchdog

log = logging.getLogger(__name__)

DEFAULT_PORT = 7999
"""ART's port for its server."""
DEFAULT_MAX_BODY_MB = 256.0
"""Train and log bodies carry every trajectory with its token ids and logprobs."""


def create_serve_app(backend: LocalBackend, *, api_key: str | None = None,
                     max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20), heartbeat_s: float = 10.0,
                     watchdog_s: float | None = ENGINE_STALL_S,
                     watchdog_train_s: float | None = TRAINING_STEP_S) -> FastAPI:
    """The whole app for `backend`. With `api_key`, every route but /health needs it.
    `watchdog_s`: seconds an engine loop may have pending work without progress, and
    `watchdog_train_s`: seconds a training step may run, before the watchdog reports them
    (0 or None: not checked). The app's lifespan runs the watchdog thread, and shutting the
    app down stops it and every model's engine."""
    watchdog = Watchdog(backend.activities, limits={"engine": watchdog_s, "training step": watchdog_train_s})
    registrations = Registrations(backend)
    app = create_app(backend, recover=registrations.recover_served, watchdog=watchdog)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        watchdog.start()
        try:
            yield
        finally:
            watchdog.stop()
            await backend.close()

    app.router.lifespan_context = lifespan
    app.include_router(management_router(backend, heartbeat_s=heartbeat_s, registrations=registrations))
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)  # added last: runs first, before any body is read
    return app


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(*, host: str, port: int, path: str, api_key: str | None, max_body_mb: float = DEFAULT_MAX_BODY_MB,
          watchdog_s: float | None = ENGINE_STALL_S, watchdog_train_s: float | None = TRAINING_STEP_S) -> None:
    """Bind, print the address, serve until SIGINT/SIGTERM (uvicorn finishes open requests,
    the app's lifespan stops the engines, then re-raises the signal)."""
    import uvicorn

    # The library's own INFO lines (a model ready, a step finished after its client left).
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("art").setLevel(logging.INFO)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # bound here so port 0 gives the real port before anything starts
    port = sock.getsockname()[1]
    url = url_for(host, port)
    # A wildcard bind is served on every address; the backend's own URL uses loopback.
    local = url_for("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host, port)
    backend = LocalBackend(path=path, served_at=local)
    app = create_serve_app(backend, api_key=api_key, max_body_bytes=int(max_body_mb * 2**20),
                           watchdog_s=watchdog_s, watchdog_train_s=watchdog_train_s)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=10,
                                           timeout_keep_alive=KEEP_ALIVE_S))
    print(f"art serve: listening on {url} (storage {path}, auth {'on' if api_key else 'off'}); "
          f"OpenAI routes at {url}/v1, management at {url}/art, schema at {url}/openapi.json", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
