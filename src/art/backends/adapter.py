"""`ServiceAdapter`: what `art.Model` and user code call, over any service (`art.service`).

It implements `art.backends.base.ServiceBackend`, the part of it `art.Model` relies on.

`LocalBackend` and `RemoteBackend` are this class over a `LocalService` or a `RemoteService`;
they add only where the OpenAI endpoint lives. Here `art.Model` objects become `ModelSpec`s
and keys, and the three sources of training options are resolved, once, before any service
sees them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from art.backends.base import ServiceBackend
from art.errors import ArtValueError, TrajectoryError
from art.service import ModelKey, ModelSpec, Progress, Service, TrainResult, resolve_train_options
from art.storage.layout import validate_name
from art.training.sft_options import resolve_sft_options
from art.trajectories import Trajectory
from art.types import TrainConfig, TrainSFTConfig

if TYPE_CHECKING:
    import httpx


def model_key(model) -> ModelKey:
    return validate_name(model.project, "project"), validate_name(model.name, "name")


def sft_trajectories(items: Iterable) -> list[Trajectory]:
    """`art.Trajectory`s as given; rows of the SFT file format (`{"messages": [...], "tools": [...]}`)
    become trajectories. Anything else is a TrajectoryError naming its index."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Trajectory):
            out.append(item)
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            try:
                out.append(Trajectory(messages_and_choices=item["messages"], tools=item.get("tools")))
            except ValueError as exc:
                raise TrajectoryError(f"trajectories[{i}]: {exc}", field=f"trajectories[{i}]") from None
        else:
            raise TrajectoryError(
                f"trajectories[{i}] is a {type(item).__name__}: train_sft takes art.Trajectory "
                'objects or {"messages": [...], "tools": [...]} rows',
                field=f"trajectories[{i}]",
            )
    return out


LOSS_FUNCTIONS = {"cispo": False, "ppo": True}
"""ART's `loss_fn` names -> our `ppo` switch."""


def art_train_names(options: dict[str, Any]) -> dict[str, Any]:
    """Newer ART's `backend.train` keywords in our option names: `loss_fn` ("cispo" or "ppo")
    is `ppo`, `normalize_advantages=False` is `scale_rewards=False`; `save_checkpoint`,
    `optimizer_save_interval` and `verbose` are accepted and change nothing (every step is
    checkpointed with its optimizer state: the update is one transaction); the defaults ART
    passes for what we do not have (`loss_fn_config`, `adam_params`, `kl_penalty_coef`) are
    accepted, anything else there is an ArtValueError naming it."""
    out = dict(options)
    loss_fn = out.pop("loss_fn", None)
    if loss_fn is not None:
        if loss_fn not in LOSS_FUNCTIONS:
            raise ArtValueError(
                f"loss_fn must be one of {', '.join(map(repr, LOSS_FUNCTIONS))}, got {loss_fn!r}", field="loss_fn"
            )
        if out.get("ppo") is not None and out["ppo"] != LOSS_FUNCTIONS[loss_fn]:
            raise ArtValueError(
                f"loss_fn={loss_fn!r} and ppo={out['ppo']!r} disagree; pass one of them", field="loss_fn"
            )
        out["ppo"] = LOSS_FUNCTIONS[loss_fn]
    elif out.get("ppo") is None:
        out.pop("ppo", None)
    normalize = out.pop("normalize_advantages", None)
    if normalize is not None:
        if not isinstance(normalize, bool):
            raise ArtValueError(
                f"normalize_advantages must be True or False, got {normalize!r}", field="normalize_advantages"
            )
        if not normalize:
            out.setdefault("scale_rewards", False)
    for name in ("save_checkpoint", "optimizer_save_interval", "verbose"):
        out.pop(name, None)
    unsupported = {
        "loss_fn_config": "a custom loss configuration",
        "adam_params": "custom optimizer parameters",
        "kl_penalty_coef": "the KL-penalised advantage (use beta, the KL term of the loss)",
    }
    for name, what in unsupported.items():
        value = out.pop(name, None)
        if value not in (None, {}, 0, 0.0):
            raise ArtValueError(f"{name} ({what}) is not supported by this backend; leave it unset", field=name)
    return out


class ServiceAdapter(ServiceBackend):
    service: Service

    def __init__(self, service: Service) -> None:
        self.service = service

    async def _endpoint(self) -> tuple[str, str]:
        """(base URL of the OpenAI routes, the key they take) for registered models."""
        raise NotImplementedError

    def openai_http_client(self, model) -> httpx.AsyncClient | None:
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

    async def train(
        self,
        model,
        trajectory_groups: Iterable,
        *,
        config: TrainConfig | None = None,
        _config: dict | None = None,
        progress: Progress | None = None,
        expected_step: int | None = None,
        **options: Any,
    ) -> TrainResult:
        """Newer ART's entry point: one update; returns the new `step` and its `metrics`. Keyword
        options (learning_rate, beta, epsilon, ..., and ART's names: `loss_fn`,
        `normalize_advantages`, `save_checkpoint`; see `art_train_names`) override `_config`
        (`art.dev.TrainConfig`), which overrides `config`. `progress` receives `art.service.TrainEvent`s while the step
        runs. With `expected_step`, a model at another step raises StepConflictError and trains
        nothing."""
        resolved = resolve_train_options(config, _config, art_train_names(options))
        return await self.service.train(
            model_key(model), list(trajectory_groups), resolved, expected_step=expected_step, progress=progress
        )

    async def train_sft(
        self,
        model,
        trajectories: Iterable,
        *,
        config: TrainSFTConfig | None = None,
        _config: dict | None = None,
        progress: Progress | None = None,
        expected_step: int | None = None,
        **options: Any,
    ) -> TrainResult:
        """Supervised fine-tuning on chat trajectories (message dicts, tools): one optimizer step
        per batch of `batch_size`, one checkpoint per call, so the step advances by one (as in
        ART). Keyword options override `_config` (`art.dev.TrainSFTConfig`), which overrides
        `config` (`art.TrainSFTConfig`). `progress` and `expected_step` as for `train`."""
        resolved = resolve_sft_options(config, _config, options)
        return await self.service.train_sft(
            model_key(model), sft_trajectories(trajectories), resolved, expected_step=expected_step, progress=progress
        )

    async def get_step(self, model) -> int:
        return await self.service.step(model_key(model))

    async def check_training_input(self, model, trajectory_groups: Iterable) -> None:
        """Raise TrajectoryError (naming the trajectory and field) for what `train` would refuse."""
        await self.service.check_training_input(model_key(model), list(trajectory_groups))

    async def cancel_training(self, model) -> bool:
        """Cancel the model's running training step (it rolls back; its `train` call raises
        StepCancelledError). False when none is running."""
        return await self.service.cancel_training(model_key(model))

    async def log(
        self, model, *, split: str, step: int, metrics: dict, groups: list, scenario_ids: Iterable[str] = ()
    ) -> dict:
        """Store a history row (already summarised by `model.log`) and the step's trajectories;
        the row as written, with the running totals it derived."""
        return await self.service.log(
            model_key(model), split=split, step=step, metrics=metrics, groups=groups, scenario_ids=list(scenario_ids)
        )

    async def list_checkpoints(self, model) -> list[int]:
        return await self.service.checkpoints(model_key(model))

    async def delete_checkpoints(
        self, model, best_checkpoint_metric: str = "val/reward", *, keep_steps: Iterable[int] | None = None
    ) -> list[int]:
        """Keep the latest step and the best by `best_checkpoint_metric` (or, given `keep_steps`,
        those steps and the latest); returns the deleted steps."""
        return await self.service.delete_checkpoints(
            model_key(model), best_checkpoint_metric, keep_steps=None if keep_steps is None else sorted(keep_steps)
        )

    async def get_history(self, model) -> list[dict]:
        """The model's history.jsonl rows, oldest first."""
        return await self.service.history(model_key(model))

    async def restart_replicas(self, model) -> list[int]:
        """Start the model's engine replicas that left the rotation again (a replica that died or
        failed the weight-sync probe); returns their indices."""
        return await self.service.restart_replicas(model_key(model))

    async def fork_checkpoint(
        self, model, from_model: str, from_project: str | None = None, *, not_after_step: int | None = None
    ) -> int:
        """Start `model` from `from_model`'s checkpoint (in `from_project`, by default the
        model's own): its latest, or its last at or before `not_after_step`, copied with its
        optimizer state under the same step number, and recorded in the model's model.json
        (`forked_from`). Before or after `model.register`: a registered model serves the forked
        weights at once. The model may not have trained steps of its own; forking the same step
        into it again does nothing. Returns the model's step afterwards."""
        source = (from_project or model.project, from_model)
        return await self.service.fork_checkpoint(ModelSpec.of(model), source, not_after_step=not_after_step)

    async def _experimental_fork_checkpoint(
        self,
        model,
        from_model: str,
        from_project: str | None = None,
        from_s3_bucket: str | None = None,
        not_after_step: int | None = None,
        verbose: bool = False,
        prefix: str | None = None,
    ) -> None:
        """ART's name for `fork_checkpoint`. Its S3 source is not supported: the source run must
        be stored under this backend's root (for `art serve`, the server's)."""
        if from_s3_bucket is not None or prefix is not None:
            raise ArtValueError(
                "forking from S3 is not supported: copy the run into the backend's storage root and fork from there",
                field="from_s3_bucket" if from_s3_bucket else "prefix",
            )
        step = await self.fork_checkpoint(model, from_model, from_project, not_after_step=not_after_step)
        if verbose:
            print(
                f"[art] forked {from_project or model.project}/{from_model} into {model.project}/{model.name}, "
                f"now at step {step}",
                file=sys.stderr,
                flush=True,
            )

    async def close(self) -> None:
        await self.service.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
