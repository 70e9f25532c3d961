"""The service API every backend speaks: register, train, log, step, checkpoints, history.

One protocol, three faces. `LocalService` (`art.service.local`) implements it in this
process over the loaded models; the management routes (`art.server.management`) put it on HTTP;
`RemoteService` (`art.backends.remote`) implements it again as that HTTP API's client. The
ART-facing classes users hold, `LocalBackend` and `RemoteBackend`, are one thin adapter
(`art.backends.adapter.ServiceAdapter`) from `art.Model` objects to this API.

Torch-free: the client side imports it. Models are named by `ModelKey` (project, name), never by
`art.Model` objects, so the server needs no stand-in model to call its own backend, and training
options reach a service resolved once (`resolve_train_options`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from typing_extensions import TypedDict  # pydantic reads its schema (the train stream's) on Python < 3.12

from art.training.options import TrainOptions, merge_option_sources
from art.training.sft_options import SFTOptions

ModelKey = tuple[str, str]
"""(project, name) of a registered model."""


@dataclass(frozen=True)
class ModelSpec:
    """What registering a model tells a service: the `art.Model` fields a server needs."""

    project: str
    name: str
    trainable: bool = False
    base_model: str | None = None
    config: Any = None
    """The user's config object (JSON-able), stored with the run."""
    internal_config: dict | None = None
    """`TrainableModel(_internal_config=...)`: engine_args, peft_args, seed, ..."""
    inference_base_url: str | None = None
    """A non-trainable model served elsewhere (a prompted baseline): only its logs live here."""
    inference_model_name: str | None = None

    @property
    def key(self) -> ModelKey:
        return self.project, self.name

    @classmethod
    def of(cls, model) -> ModelSpec:
        """The spec of an `art.Model` or `art.TrainableModel`."""
        config = model.config.model_dump() if hasattr(model.config, "model_dump") else model.config
        trainable = bool(getattr(model, "trainable", False))
        return cls(
            project=model.project,
            name=model.name,
            trainable=trainable,
            base_model=getattr(model, "base_model", None),
            config=config,
            internal_config=getattr(model, "_internal_config", None),
            inference_base_url=None if trainable else model.inference_base_url,
            inference_model_name=None if trainable else model.inference_model_name,
        )


@dataclass
class TrainResult:
    step: int
    """The step now served (the checkpoint this update wrote)."""
    metrics: dict[str, float]


class TrainEvent(TypedDict, total=False):
    """What a running update reports to `train(progress=...)`, and one line of the HTTP train
    stream: `accepted` (valid; `step` is the step it will write), one `gradient_step` per
    optimizer step, `heartbeat` while nothing else is said, then `result` or `error` (OpenAI's
    error object plus its HTTP `status`)."""

    type: Literal["accepted", "gradient_step", "heartbeat", "result", "error"]
    step: int
    done: int
    total: int
    metrics: dict[str, float]
    groups: int
    trajectories: int
    elapsed_s: float
    error: dict[str, Any]


Progress = Callable[[TrainEvent], None]


def resolve_train_options(
    config=None, dev_config: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None
) -> TrainOptions:
    """The one place training options are merged and checked (`merge_option_sources`)."""
    return merge_option_sources(lambda merged: TrainOptions.build(None, merged), config, dev_config, options)


class Service(Protocol):
    """The backend protocol. Every method names its model by key; `train` takes options already
    resolved. Errors are `art.errors` exceptions (ModelNotFoundError, StepConflictError, ...)."""

    async def register(self, spec: ModelSpec) -> int:
        """Load (or find) the model; returns its latest step (0 for a fresh or non-trainable one)."""
        ...

    async def specs(self) -> list[ModelSpec]:
        """The models registered so far (on a server, the stored runs it loaded again included)."""
        ...

    async def step(self, key: ModelKey) -> int: ...

    async def train(
        self,
        key: ModelKey,
        groups: list,
        options: TrainOptions,
        *,
        expected_step: int | None = None,
        progress: Progress | None = None,
    ) -> TrainResult:
        """One update. With `expected_step`, a model at another step raises StepConflictError
        and trains nothing."""
        ...

    async def train_sft(
        self,
        key: ModelKey,
        trajectories: list,
        options: SFTOptions,
        *,
        expected_step: int | None = None,
        progress: Progress | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning on chat trajectories (`art.training.sft`): one optimizer step
        per batch, one checkpoint per call (the step advances by one). `progress` and
        `expected_step` as for `train`."""
        ...

    async def check_training_input(self, key: ModelKey, groups: list) -> None:
        """Raise TrajectoryError (naming the trajectory and field) for what `train` would refuse."""
        ...

    async def cancel_training(self, key: ModelKey) -> bool:
        """Stop the running update (it rolls back); False when none was running."""
        ...

    async def log(
        self, key: ModelKey, *, split: str, step: int, metrics: dict, groups: list, scenario_ids: Iterable[str] = ()
    ) -> dict:
        """Write the step's trajectories and append a history row (with what the run's running
        totals derive from it, counting `scenario_ids` as seen); the row as written."""
        ...

    async def checkpoints(self, key: ModelKey) -> list[int]: ...

    async def delete_checkpoints(
        self, key: ModelKey, best_checkpoint_metric: str, keep_steps: list[int] | None = None
    ) -> list[int]:
        """Keep the latest step and the best by the metric (or, given `keep_steps`, those
        steps); returns the deleted steps."""
        ...

    async def history(self, key: ModelKey) -> list[dict]:
        """The model's history rows, oldest first."""
        ...

    async def restart_replicas(self, key: ModelKey) -> list[int]:
        """Start the model's engine replicas that left the rotation again, on the current
        weights; returns their indices (empty without replicas)."""
        ...

    async def fork_checkpoint(self, spec: ModelSpec, source: ModelKey, *, not_after_step: int | None = None) -> int:
        """Start `spec`'s model from `source`'s checkpoint (its latest, or its last at or before
        `not_after_step`), copied under the same step number (`art.storage.fork`); returns the
        model's step afterwards. A registered model serves the forked weights at once."""
        ...

    async def close(self) -> None: ...
