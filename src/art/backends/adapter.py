"""`ServiceBackend`: what `art.Model` and user code call, over any service (`art.service`).

`LocalBackend` and `RemoteBackend` are this class over a `LocalService` or a `RemoteService`;
they add only where the OpenAI endpoint lives. Here `art.Model` objects become `ModelSpec`s
and keys, and the three sources of training options are resolved, once, before any service
sees them.
"""

from __future__ import annotations

from typing import Any, Iterable

from art.service import ModelKey, ModelSpec, Progress, Service, TrainResult, resolve_train_options
from art.storage.layout import validate_name
from art.types import TrainConfig


def model_key(model) -> ModelKey:
    return validate_name(model.project, "project"), validate_name(model.name, "name")


class ServiceBackend:
    service: Service

    def __init__(self, service: Service) -> None:
        self.service = service

    async def _endpoint(self) -> tuple[str, str]:
        """(base URL of the OpenAI routes, the key they take) for registered models."""
        raise NotImplementedError

    def openai_http_client(self, model):
        """The httpx client `model.openai_client()` should use (None: its own, over the network)."""
        return None

    async def register(self, model) -> None:
        """Load (or find) the model; afterwards its `openai_client()` talks to this backend (a
        non-trainable model with its own `inference_base_url` keeps it: only its logs live here)."""
        spec = ModelSpec.of(model)
        await self.service.register(spec)
        if not spec.trainable and spec.inference_base_url is not None:
            return
        model.inference_base_url, model.inference_api_key = await self._endpoint()
        model.inference_model_name = model.name

    async def train(self, model, trajectory_groups: Iterable, *, config: TrainConfig | None = None,
                    _config: dict | None = None, progress: Progress | None = None, expected_step: int | None = None,
                    **options: Any) -> TrainResult:
        """Newer ART's entry point: one update; returns the new `step` and its `metrics`. Keyword
        options (learning_rate, beta, epsilon, ...) override `_config` (`art.dev.TrainConfig`),
        which overrides `config`. `progress` receives `art.service.TrainEvent`s while the step
        runs. With `expected_step`, a model at another step raises StepConflictError and trains
        nothing."""
        resolved = resolve_train_options(config, _config, options)
        return await self.service.train(model_key(model), list(trajectory_groups), resolved,
                                        expected_step=expected_step, progress=progress)

    async def get_step(self, model) -> int:
        return await self.service.step(model_key(model))

    async def check_training_input(self, model, trajectory_groups: Iterable) -> None:
        """Raise TrajectoryError (naming the trajectory and field) for what `train` would refuse."""
        await self.service.check_training_input(model_key(model), list(trajectory_groups))

    async def cancel_training(self, model) -> bool:
        """Cancel the model's running training step (it rolls back; its `train` call raises
        StepCancelledError). False when none is running."""
        return await self.service.cancel_training(model_key(model))

    async def log(self, model, *, split: str, step: int, metrics: dict, groups: list) -> None:
        """Store a history row (already summarised by `model.log`) and the step's trajectories."""
        await self.service.log(model_key(model), split=split, step=step, metrics=metrics, groups=groups)

    async def list_checkpoints(self, model) -> list[int]:
        return await self.service.checkpoints(model_key(model))

    async def delete_checkpoints(self, model, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Keep the latest step and the best by `best_checkpoint_metric`; returns the deleted steps."""
        return await self.service.delete_checkpoints(model_key(model), best_checkpoint_metric)

    async def get_history(self, model) -> list[dict]:
        """The model's history.jsonl rows, oldest first."""
        return await self.service.history(model_key(model))

    async def restart_replicas(self, model) -> list[int]:
        """Start the model's engine replicas that left the rotation again (a replica that died or
        failed the weight-sync probe); returns their indices."""
        return await self.service.restart_replicas(model_key(model))

    async def close(self) -> None:
        await self.service.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
