"""`LocalBackend`: serve and train on this machine, in this process.

The service API over the models loaded here (`LocalService`), plus one loopback HTTP server
(the OpenAI routes and the dashboard) shared by all registered models. It holds no training or
sampling code itself.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from art.backends.adapter import ServiceBackend
from art.backends.local_service import LocalService

log = logging.getLogger(__name__)


class LocalBackend(ServiceBackend):
    service: LocalService

    def __init__(self, *, in_process: bool = True, path: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, placement: str = "processes") -> None:
        """`path`: run storage root (default `./.art`). `port` 0 picks a free port for the
        loopback server, started when the first model registers. `placement`: where engine
        replicas and trainer ranks beyond the first run, "processes" or "ray" (see `art.ray_cluster`)."""
        if not in_process:
            log.warning("LocalBackend(in_process=False) is not supported yet; running in process")
        super().__init__(LocalService(Path(path) if path is not None else Path(".art"), placement=placement))
        self._host, self._port = host, port
        self._server = None

    @property
    def root(self) -> Path:
        """The storage root of this backend's runs."""
        return self.service.root

    @property
    def server_url(self) -> str | None:
        """The base URL of the OpenAI routes and the dashboard (None until a model registers)."""
        return self._server.base_url if self._server is not None else None

    async def register(self, model) -> None:
        model.base_path = str(self.root)
        await super().register(model)

    async def _endpoint(self) -> tuple[str, str]:
        return f"{await asyncio.to_thread(self._ensure_server)}/v1", "art-local"

    def _ensure_server(self) -> str:
        if self._server is None:
            from art.dashboard import dashboard_router
            from art.server.app import create_app
            from art.server.thread import ServerThread

            app = create_app(self.service)
            app.include_router(dashboard_router(self.root))
            self._server = ServerThread(app, host=self._host, port=self._port)
            self._server.start()
            print(f"[art] dashboard: {self._server.base_url}/dashboard (while this process runs; "
                  f"`art dashboard --path {self.root}` serves it on its own)", file=sys.stderr, flush=True)
        return self._server.base_url

    async def close(self) -> None:
        """Stop the HTTP server and every model's engine; the backend cannot be reused."""
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None
        await self.service.close()
