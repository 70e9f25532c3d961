"""`LocalBackend`: serve and train on this machine, in this process.

It owns one loopback HTTP server (the OpenAI routes) shared by all registered models, and one
`ModelService` per model. It holds no training or sampling code itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from pathlib import Path
from typing import Callable

from art.errors import ModelNotFoundError
from art.naming import echo
from art.server.registry import ServedModel
from art.storage.history import read_history
from art.storage.layout import ModelDir, stored_runs
from art.storage.run_log import write_log
from art.types import TrainConfig

log = logging.getLogger(__name__)


class LocalBackend:
    def __init__(self, *, in_process: bool = True, path: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, served_at: str | None = None) -> None:
        """`path`: run storage root (default `./.art`). `port` 0 picks a free port. `served_at`:
        the base URL of an app that already serves this backend (`art serve`); no server is started."""
        if not in_process:
            log.warning("LocalBackend(in_process=False) is not supported yet; running in process")
        self._root = Path(path) if path is not None else Path(".art")
        self._host, self._port = host, port
        self._services: dict[tuple[str, str], object] = {}
        self._server = None
        self._served_at = served_at

    @property
    def root(self) -> Path:
        """The storage root of this backend's runs."""
        return self._root

    # -- the registry the HTTP app resolves names with --------------------------------------
    def served_model_names(self) -> list[str]:
        names: list[str] = []
        for service in self._services.values():
            names += service.served_names()
            if service.base_model not in names and not service.full_finetune:
                names.append(service.base_model)
        return names

    def resolve(self, model: str) -> ServedModel:
        specific = None  # a service that knows the name says why it cannot serve it
        for service in self._services.values():
            try:
                return service.resolve(model)
            except ModelNotFoundError as exc:
                if model.partition("@")[0] in (service.name, service.base_model):
                    specific = specific or exc
        if specific is not None:
            raise specific
        raise ModelNotFoundError(f"The model {echo(model)} does not exist; served: {self.served_model_names()}")

    def stats(self) -> dict[str, dict]:
        """Engine load per model, shown by GET /health."""
        return {f"{project}/{name}": service.stats() for (project, name), service in self._services.items()}

    def activities(self) -> list:
        """What a watchdog (`art.server.watchdog`) checks: each model's engine loop (seconds
        without progress while it has work) and its running training step (seconds running)."""
        from art.server.watchdog import Activity

        now, out = time.monotonic(), []
        for (project, name), service in list(self._services.items()):
            engine = service.engine
            out.append(Activity("engine", f"{project}/{name}", engine.stalled_s(), engine.thread_id))
            since, thread = service.training_since, service.training_thread
            if since is not None:
                out.append(Activity("training step", f"{project}/{name}", now - since, thread))
        return out

    # -- runs stored under the root (a restarted server finds its models here) ---------------
    def stored_model(self, project: str, name: str) -> dict | None:
        """The model.json of a trainable model's run under this backend's root, or None."""
        return ModelDir(self._root, project, name).read_model_json()

    def stored_models(self, name: str) -> list[tuple[str, str]]:
        """(project, name) of every stored run of a trainable model called `name`."""
        return [key for key in stored_runs(self._root) if key[1] == name]

    # -- the protocol models call -----------------------------------------------------------
    async def register(self, model) -> None:
        model.base_path = str(self._root)
        if getattr(model, "trainable", False):
            key = (model.project, model.name)
            if key not in self._services:
                from art.model_service import ModelService  # heavy: torch, transformers

                config = model.config.model_dump() if hasattr(model.config, "model_dump") else model.config
                self._services[key] = await asyncio.to_thread(
                    ModelService, self._root, name=model.name, project=model.project,
                    base_model=model.base_model, internal_config=model._internal_config, user_config=config,
                )
        elif model.inference_base_url is not None:
            return  # a prompted baseline on its own endpoint: only its logs live here
        base_url = await asyncio.to_thread(self._ensure_server)
        model.inference_base_url = f"{base_url}/v1"
        model.inference_api_key = model.inference_api_key or "art-local"
        model.inference_model_name = model.name

    async def _get_step(self, model) -> int:
        service = self._services.get((model.project, model.name))
        return service.step if service is not None else 0

    async def train(self, model, trajectory_groups, *, config: TrainConfig | None = None,
                    _config: dict | None = None, progress: Callable[[dict], None] | None = None,
                    expected_step: int | None = None, **options):
        """Newer ART's entry point: one update; returns a result with `step` and `metrics`.
        Extra keyword options (learning_rate, beta, epsilon, ...) override `config`. `progress`
        receives event dicts while the step runs (see `ModelService.train`). With
        `expected_step`, a model at another step raises StepConflictError and trains nothing."""
        from art.training.options import TrainOptions

        merged = {**(config.model_dump() if config else {}), **(_config or {}), **options}
        service = self._service(model)
        return await service.train(list(trajectory_groups), TrainOptions.build(None, merged), progress=progress,
                                   expected_step=expected_step)

    async def check_training_input(self, model, trajectory_groups) -> None:
        """Raise TrajectoryError (naming the trajectory and field) for what `train` would refuse."""
        await asyncio.to_thread(self._service(model).check_groups, list(trajectory_groups))

    async def cancel_training(self, model) -> bool:
        """Cancel the model's running training step (it rolls back); False when none is running."""
        return self._service(model).cancel()

    async def _train_model(self, model, groups, config: TrainConfig, dev_config: dict, verbose: bool = False):
        return await self.train(model, groups, config=config, _config=dev_config)

    async def _log(self, model, *, split: str, step: int, metrics: dict, groups) -> None:
        directory = ModelDir(self._root, model.project, model.name)
        await asyncio.to_thread(write_log, directory, split=split, step=step, metrics=metrics, groups=groups)

    async def _delete_checkpoints(self, model, best_checkpoint_metric: str) -> list[int]:
        service = self._service(model)
        best = best_step(read_history(service.dir.history), best_checkpoint_metric)
        keep = {service.step} | ({best} if best is not None else set())
        if best is None:
            log.warning("no %r in history: keeping only the latest checkpoint", best_checkpoint_metric)
        return await asyncio.to_thread(service.delete_checkpoints, keep)

    async def _list_checkpoints(self, model) -> list[int]:
        return await asyncio.to_thread(self._service(model).store.steps)

    async def _get_history(self, model) -> list[dict]:
        """The model's history.jsonl rows (empty when nothing was logged)."""
        return await asyncio.to_thread(read_history, ModelDir(self._root, model.project, model.name).history)

    def _service(self, model):
        service = self._services.get((model.project, model.name))
        if service is None:
            raise ModelNotFoundError(f"model {model.project}/{model.name} is not registered with this backend")
        return service

    # -- server lifecycle -------------------------------------------------------------------
    def _ensure_server(self) -> str:
        if self._served_at is not None:
            return self._served_at
        if self._server is None:
            from art.dashboard import dashboard_router
            from art.server.app import create_app
            from art.server.thread import ServerThread

            app = create_app(self)
            app.include_router(dashboard_router(self._root))
            self._server = ServerThread(app, host=self._host, port=self._port)
            self._server.start()
            print(f"[art] dashboard: {self._server.base_url}/dashboard (while this process runs; "
                  f"`art dashboard --path {self._root}` serves it on its own)", file=sys.stderr, flush=True)
        return self._server.base_url

    async def close(self) -> None:
        """Stop the HTTP server and every model's engine; the backend cannot be reused."""
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None
        for service in self._services.values():
            await asyncio.to_thread(service.close)
        self._services.clear()

    async def __aenter__(self) -> "LocalBackend":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def best_step(history: list[dict], metric: str) -> int | None:
    """The step whose rows have the highest mean of `metric` (None when it was never logged)."""
    values: dict[int, list[float]] = {}
    for row in history:
        value, step = row.get(metric), row.get("step")
        if isinstance(value, (int, float)) and math.isfinite(value) and type(step) is int:
            values.setdefault(step, []).append(float(value))
    if not values:
        return None
    return max(values, key=lambda s: sum(values[s]) / len(values[s]))
