"""`Model` (any OpenAI-compatible model, e.g. a prompted baseline) and `TrainableModel`.

These are client objects: they hold names and a backend, never weights, and import no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from pydantic import BaseModel, ConfigDict, PrivateAttr

from art.errors import ArtValueError
from art.metrics import summarize
from art.observability import log_to_wandb, tracing
from art.observability.weave_sink import init_weave
from art.storage.layout import ModelDir, validate_name, write_atomic
from art.storage.run_log import write_log
from art.trajectories import Trajectory, TrajectoryGroup
from art.types import TrainConfig, TrainSFTConfig

if TYPE_CHECKING:
    from art.backends.base import Backend

STATE_FILE = "state.json"


class Model(BaseModel):
    """A model rollouts can call and whose results can be logged; not trainable."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    project: str
    entity: str | None = None
    id: str | None = None
    config: Any = None
    """Any user object (usually a pydantic model) stored with the run."""
    trainable: bool = False
    base_path: str = ".art"
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None

    _backend: Backend | None = PrivateAttr(default=None)
    _client: AsyncOpenAI | None = PrivateAttr(default=None)

    def model_post_init(self, __context: Any) -> None:
        validate_name(self.name, "name")
        validate_name(self.project, "project")

    async def register(self, backend: Backend) -> None:
        """Bind to a backend; afterwards `openai_client()` talks to it. With `WANDB_API_KEY` set
        and Weave installed, Weave starts tracing the project (`art.observability.weave_sink`)."""
        await backend.register(self)
        init_weave(self.project)
        self._backend = backend
        self._client = None

    def openai_client(self) -> AsyncOpenAI:
        """An AsyncOpenAI client for this model's endpoint (long timeouts: CPU sampling is slow)."""
        if self.inference_base_url is None:
            raise ArtValueError(
                f"model {self.name!r} has no inference endpoint: call `await model.register(backend)` "
                "or pass inference_base_url", field="inference_base_url")
        if self._client is None:
            self._client = AsyncOpenAI(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "none",
                timeout=httpx.Timeout(timeout=1800.0, connect=10.0),
                max_retries=0,
                # A backend that reaches its server through a custom transport supplies the client.
                http_client=(self._backend.openai_http_client(self) if self._backend is not None else None)
                or DefaultAsyncHttpxClient(event_hooks={"request": [tracing.inject_headers]}),
            )
        return self._client

    def get_inference_name(self, step: int | None = None) -> str:
        """The `model` field for requests: the latest weights, or those of `step`."""
        base = self.inference_model_name or self.name
        return base if step is None else f"{base}@{step}"

    async def get_step(self) -> int:
        return await self._backend.get_step(self) if self._backend is not None else 0

    async def log(
        self,
        trajectories: Iterable[Trajectory | TrajectoryGroup] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        """Average rewards and metrics of the trajectories, prefix them `split/`, append a row
        to history.jsonl and write the trajectories of the step."""
        validate_name(split, "split")
        groups = _as_groups(trajectories)
        row: dict[str, float] = {}
        if groups:
            row.update({f"{split}/{k}": v for k, v in summarize(groups).items()})
        for key, value in (metrics or {}).items():
            row[key if "/" in key else f"{split}/{key}"] = value
        step = await self.get_step() if step is None else step
        log_to_wandb(self, step=step, metrics=row, run_dir=self._run_dir())
        if self._backend is not None:
            await self._backend.log(self, split=split, step=step, metrics=row, groups=groups)
        else:
            write_log(ModelDir(self.base_path, self.project, self.name), split=split, step=step,
                      metrics=row, groups=groups)

    def read_state(self) -> dict | None:
        """The run's saved user state (`state.json` in its folder, ART's name), or None."""
        try:
            state = json.loads((self._run_dir() / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def merge_state(self, state: dict) -> None:
        """Merge `state` (JSON-serialisable) into the run's `state.json`, atomically: a killed
        process leaves the old state or the new one (`art.PipelineTrainer` resumes from it)."""
        folder = self._run_dir()
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / STATE_FILE, json.dumps({**(self.read_state() or {}), **state}, indent=2))

    def _run_dir(self) -> Path:
        return ModelDir(self.base_path, self.project, self.name).path


class TrainableModel(Model):
    """The policy being trained: a LoRA adapter (by default) on `base_model`."""

    base_model: str
    trainable: bool = True
    _internal_config: dict | None = PrivateAttr(default=None)

    def __init__(self, *, _internal_config: dict | None = None, **data: Any) -> None:
        super().__init__(**data)
        self._internal_config = dict(_internal_config) if _internal_config else None

    async def train(
        self,
        trajectory_groups: Iterable[TrajectoryGroup],
        config: TrainConfig = TrainConfig(),
        _config: dict | None = None,
        verbose: bool = False,
    ) -> None:
        """One GRPO update; returns once the new step is saved and served. The groups' rewards
        and the update's metrics are logged under `train/` at the step that sampled them.
        (`verbose` is ART's; the backend's progress bar shows the step either way.)"""
        backend = self._require_backend()
        stats = getattr(trajectory_groups, "stats", None)  # from gather_trajectory_groups
        groups = list(trajectory_groups)
        step = await self.get_step()
        with tracing.span("art.train", {"art.model": f"{self.project}/{self.name}", "art.step_from": step,
                                        "art.groups": len(groups)}):
            result = await backend.train(self, groups, config=config, _config=_config)
        metrics = {f"train/{k}": v for k, v in result.metrics.items()}
        metrics.update(_rollout_spending(groups, stats, result.metrics.get("groups_trained")))
        await self.log(groups, split="train", metrics=metrics, step=step)

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        _config: dict | None = None,
        verbose: bool = False,
        log_metrics: bool = True,
    ) -> None:
        """Supervised fine-tuning on chat trajectories (ART's `model.train_sft`): the backend
        renders each conversation with the model's chat template and trains its assistant
        messages, one optimizer step per batch. One call writes one checkpoint, so `get_step()`
        advances by one (as in ART); `art.utils.sft` splits a dataset into calls with a learning-
        rate schedule. The metrics are logged under `sft/` at the step it trained from, like
        `train`'s, unless `log_metrics` is False. (`verbose` is ART's; the backend's progress bar
        shows the batches.)"""
        backend = self._require_backend()
        step = await self.get_step()
        with tracing.span("art.train_sft", {"art.model": f"{self.project}/{self.name}", "art.step_from": step}):
            result = await backend.train_sft(self, trajectories, config=config, _config=_config)
        if log_metrics:
            await self.log(split="train", metrics={f"sft/{k}": v for k, v in result.metrics.items()}, step=step)

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Keep the latest checkpoint and the best by `best_checkpoint_metric`; delete the rest."""
        return await self._require_backend().delete_checkpoints(self, best_checkpoint_metric)

    def _require_backend(self) -> Backend:
        if self._backend is None:
            raise ArtValueError(f"model {self.name!r} is not registered: `await model.register(backend)` first")
        return self._backend


def _rollout_spending(groups: list[TrajectoryGroup], stats, groups_trained) -> dict[str, float]:
    """How many rollouts the step spent for each group it trained on: the gather's own count
    when the groups came from `gather_trajectory_groups` (dropped groups included), else the
    rollouts handed to train."""
    rollouts = stats.rollouts if stats is not None else sum(len(g.trajectories) for g in groups)
    out = {"train/rollouts": float(rollouts)}
    if stats is not None and stats.groups_without_signal:
        out["train/groups_without_signal"] = float(stats.groups_without_signal)
        out["train/reward_all_rollouts"] = stats.reward_mean  # train/reward covers the kept groups only
    if groups_trained:
        out["train/rollouts_per_trained_group"] = rollouts / groups_trained
    return out


def _as_groups(items) -> list[TrajectoryGroup]:
    if items is None:
        return []
    items = list(items)
    groups = [item for item in items if isinstance(item, TrajectoryGroup)]
    loose = [item for item in items if isinstance(item, Trajectory)]
    if len(groups) + len(loose) != len(items):
        raise ArtValueError("log() takes Trajectory or TrajectoryGroup objects", field="trajectories")
    if loose:
        groups.append(TrajectoryGroup(loose))
    return groups
