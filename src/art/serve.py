"""The app `art serve` runs: a `LocalService`, reachable over HTTP (the command is `art.cli`).

The composition root: it wires the OpenAI routes (`art.server.app`), the management routes
(`art.server.management`) and the dashboard (`art.dashboard`, under /dashboard), behind a
bearer key and a request-size bound (`art.server.security`); with a key, a browser logs in to
the dashboard with a form (`art.dashboard.login`). None of those parts knows the others. Unlike `LocalBackend`'s own
loopback server, this one is meant to be reached from other machines (the `art serve` command
refuses a non-loopback address without a key).
A restarted server loads stored runs again when a request names them
(`LocalService.spec`), and a watchdog thread (`art.service.watchdog`) reports a stuck
engine loop or training step in the log and on /health. On SIGINT/SIGTERM (`ArtServer`) the
running training steps are abandoned first: each rolls back, its client is told, and one log
line says at which step the model stays; then the server exits without waiting them out.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from art.dashboard import dashboard_router, login
from art.server.app import create_app
from art.server.management import management_router
from art.server.security import BearerAuth, BodyLimit, RefuseQueryCredentials
from art.server.train_stream import RunningSteps
from art.service.watchdog import ENGINE_STALL_S, TRAINING_STEP_S, Watchdog

if TYPE_CHECKING:
    from art.service.local import LocalService

log = logging.getLogger(__name__)

DEFAULT_PORT = 7999
"""ART's port for its server."""
DEFAULT_MAX_BODY_MB = 256.0
"""Train and log bodies carry every trajectory with its token ids and logprobs."""
DEFAULT_MAX_CHAT_BODY_MB = 8.0
"""Chat requests (/v1): room for long agent contexts, not for a prompt that takes minutes to tokenise."""


def create_serve_app(
    service: LocalService,
    *,
    api_key: str | None = None,
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20),
    max_chat_body_bytes: int = int(DEFAULT_MAX_CHAT_BODY_MB * 2**20),
    heartbeat_s: float = 10.0,
    watchdog_s: float | None = ENGINE_STALL_S,
    watchdog_train_s: float | None = TRAINING_STEP_S,
    model_roots: list | None = None,
) -> FastAPI:
    """The whole app for `service`. With `api_key`, every route but /health needs it (and
    /health shows details only with it); /dashboard also takes the cookie its login form sets.
    Bodies are bounded by `max_chat_body_bytes` on /v1 and `max_body_bytes` elsewhere.
    `watchdog_s`: seconds an engine loop may have pending work without progress, and
    `watchdog_train_s`: seconds a training step may run, before the watchdog reports them (0 or
    None: not checked). `model_roots`: the server folders a registered `base_model` path may
    point into (None: any). The app's lifespan runs the watchdog thread, and shutting the app
    down logs what became of the abandoned training steps, then stops the watchdog and every
    model's engine."""
    watchdog = Watchdog(service.activities, limits={"engine": watchdog_s, "training step": watchdog_train_s})
    app = create_app(service, recover=service.recover_served, watchdog=watchdog)
    running = RunningSteps()

    async def abandon_training() -> None:
        await running.abandon(service)

    app.state.abandon_training = abandon_training  # `ArtServer` calls it once a shutdown begins

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        watchdog.start()
        try:
            yield
        finally:
            await running.settle(service)  # one line per abandoned step: what became of it
            watchdog.stop()
            await service.close()

    app.router.lifespan_context = lifespan
    app.include_router(management_router(service, heartbeat_s=heartbeat_s, model_roots=model_roots, running=running))
    app.include_router(dashboard_router(service.root, logout=bool(api_key)))  # /dashboard, behind the same key
    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes,
        path_limits={"/v1/": max_chat_body_bytes, login.LOGIN_PATH: login.LOGIN_MAX_BYTES},
    )
    if api_key:
        app.include_router(login.login_router(api_key))
        app.add_middleware(
            BearerAuth,
            api_key=api_key,
            open_paths=login.OPEN_PATHS,  # runs before any body is read
            session=login.session_check(api_key),
            login_form=login.login_form_for,
        )
    app.add_middleware(RefuseQueryCredentials)  # added last: runs first, even before the key check
    return app


class ArtServer(uvicorn.Server):
    """uvicorn's server for `create_serve_app`'s app. On SIGINT/SIGTERM, before uvicorn waits for
    open connections, the running training steps are abandoned: each stops at its next
    micro-batch and rolls back, and its stream ends with an error that says so. Left running,
    a step kept its stream open until uvicorn's graceful timeout cancelled it, with a long
    CancelledError traceback and no word on what became of the step."""

    async def shutdown(self, sockets=None) -> None:
        abandon = getattr(getattr(self.config.app, "state", None), "abandon_training", None)
        try:
            if abandon is not None:
                await abandon()
        finally:
            await super().shutdown(sockets)
