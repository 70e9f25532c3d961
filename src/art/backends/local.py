"""`LocalBackend`: serve and train on this machine, in this process or in a child process.

In process: the service API over the models loaded here (`LocalService`), plus one loopback
HTTP server (the OpenAI routes and the dashboard) shared by all registered models. With
`in_process=False`: `art serve`'s app in a child process on loopback, spoken to as a remote
server (`art.backends.child`), so a crash in the backend cannot take the user's process down.
It holds no training or sampling code itself.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from art.backends.adapter import ServiceAdapter
from art.backends.child import ChildService
from art.errors import ArtValueError
from art.service.local import LocalService

if TYPE_CHECKING:
    from art.server.thread import ServerThread


class LocalBackend(ServiceAdapter):
    service: LocalService | ChildService

    def __init__(
        self,
        *,
        in_process: bool = True,
        path: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        placement: str = "processes",
        gpu_cost_per_hour_usd: float | None = None,
    ) -> None:
        """`path`: run storage root (default `./.art`). `port` 0 picks a free port for the
        loopback server, started when the first model registers. `placement`: where engine
        replicas and trainer ranks beyond the first run, "processes" or "ray" (see `art.ray_cluster`).
        `in_process=False`: models load in a child process, started on the first register and
        stopped by `close` or when this process exits; if it dies, calls raise BackendError and
        the next register starts a new one (`art.backends.child`). Same storage layout.
        `gpu_cost_per_hour_usd`: what this machine costs; each train row then adds `costs/gpu`
        (its `time/step_wall_s` at that rate) and the cost roll-ups. None: no cost is logged."""
        if gpu_cost_per_hour_usd is not None and not (
            isinstance(gpu_cost_per_hour_usd, (int, float)) and 0 <= gpu_cost_per_hour_usd < 1e6
        ):
            raise ArtValueError(
                f"gpu_cost_per_hour_usd must be a number of dollars in [0, 1e6), got {gpu_cost_per_hour_usd!r}",
                field="gpu_cost_per_hour_usd",
            )
        self.gpu_cost_per_hour_usd = gpu_cost_per_hour_usd
        root = Path(path) if path is not None else Path(".art")
        if in_process:
            super().__init__(LocalService(root, placement=placement))
        else:
            super().__init__(ChildService(root, placement=placement, host=host, port=port))
        self.in_process = in_process
        self._host, self._port = host, port
        self._server: ServerThread | None = None

    @property
    def root(self) -> Path:
        """The storage root of this backend's runs."""
        return self.service.root

    @property
    def server_url(self) -> str | None:
        """The base URL of the OpenAI routes and the dashboard (None until a model registers)."""
        if isinstance(self.service, ChildService):
            return self.service.child.url if self.service.child is not None else None
        return self._server.base_url if self._server is not None else None

    async def register(self, model) -> None:
        model.base_path = str(self.root)
        await super().register(model)

    async def _endpoint(self) -> tuple[str, str]:
        if isinstance(self.service, ChildService):
            child = await self.service.ensure_started()
            return f"{child.url}/v1", child.key
        return f"{await asyncio.to_thread(self._ensure_server, self.service)}/v1", "art-local"

    def _ensure_server(self, service: LocalService) -> str:
        """The loopback server's base URL, started on first use over `service` (this backend's)."""
        if self._server is None:
            from art.dashboard import dashboard_router
            from art.server.app import create_app
            from art.server.thread import ServerThread

            app = create_app(service)
            app.include_router(dashboard_router(self.root))
            self._server = ServerThread(app, host=self._host, port=self._port)
            self._server.start()
            print(
                f"[art] dashboard: {self._server.base_url}/dashboard (while this process runs; "
                f"`art dashboard --path {self.root}` serves it on its own)",
                file=sys.stderr,
                flush=True,
            )
        return self._server.base_url

    async def close(self) -> None:
        """Stop the HTTP server and every model's engine (or the child process); the backend
        cannot be reused."""
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None
        await self.service.close()
