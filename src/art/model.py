"""`Model` (any OpenAI-compatible model, e.g. a prompted baseline) and `TrainableModel`.

These are client objects: they hold names and a backend, never weights, and import no torch.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError
from typing_extensions import TypeVar

from art.costs import CostCalculator
from art.errors import ArtValueError
from art.metrics import MetricsBuilder, SharedMetrics, active_builder, data_counts, group_scenario_ids, summarize
from art.metrics_taxonomy import SFT_WANDB_GRADIENT_STEP_KEY, route
from art.observability import log_to_wandb, tracing, update_wandb_config
from art.observability.weave_sink import init_weave
from art.storage.checkpoints import complete_steps
from art.storage.layout import ModelDir, validate_name, write_atomic
from art.storage.run_log import write_log
from art.training.sft_history import history_rows
from art.trajectories import Trajectory, TrajectoryGroup
from art.types import TrainConfig, TrainSFTConfig

if TYPE_CHECKING:
    from art.backends.base import ServiceBackend

STATE_FILE = "state.json"

ModelConfig = TypeVar("ModelConfig", default=Any)
"""The type of `Model.config` (ART's generic parameter): `Model[MyConfig]` validates `config`
as a `MyConfig`; a bare `Model` takes any object."""
StateType = TypeVar("StateType", bound=dict, default=dict[str, Any])
"""The type of the run's saved state (`read_state`), ART's second generic parameter."""


class Model(BaseModel, Generic[ModelConfig, StateType]):
    """A model rollouts can call and whose results can be logged; not trainable.

    Generic as ART's is (`Model[MyConfig]`, `TrainableModel[Any, dict]`), and strict about its
    keywords: an unknown one is an `ArtValueError` naming it, never dropped (a misspelt option
    would otherwise change nothing, silently)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    name: str
    project: str
    entity: str | None = None
    id: str | None = None
    run_id: str | None = None
    """ART's W&B run id field; stored with the model, not used to name anything here."""
    config: ModelConfig | None = None
    """Any user object (usually a pydantic model) stored with the run."""
    trainable: bool = False
    base_path: str = ".art"
    inference_api_key: str | None = None
    inference_base_url: str | None = None
    inference_model_name: str | None = None
    report_metrics: list[str] | None = None
    """Where metrics go besides history.jsonl: None means W&B when `WANDB_API_KEY` is set (or
    `WANDB_MODE=offline`); `["wandb"]` always; `[]` nowhere else."""

    _backend: ServiceBackend | None = PrivateAttr(default=None)
    _client: AsyncOpenAI | None = PrivateAttr(default=None)
    _wandb_config: dict = PrivateAttr(default_factory=dict)
    _cost_calculator: CostCalculator | None = PrivateAttr(default=None)
    _builders: SharedMetrics | None = PrivateAttr(default=None)
    _created: float = PrivateAttr(default_factory=time.time)
    _last_train_log: float = PrivateAttr(default_factory=time.monotonic)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            ours = [e["ctx"]["error"] for e in exc.errors() if isinstance(e.get("ctx", {}).get("error"), ArtValueError)]
            if ours:  # raised by our own checks (model_post_init): as they are, with their field
                raise ours[0] from None
            unknown = [str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden" and e["loc"]]
            if not unknown:
                raise
            known = ", ".join(sorted(type(self).model_fields))
            raise ArtValueError(
                f"{type(self).__name__}() got unknown keyword{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; it takes: {known}",
                field=unknown[0],
            ) from None

    def model_post_init(self, __context: Any) -> None:
        validate_name(self.name, "name")
        validate_name(self.project, "project")

    def backend(self) -> ServiceBackend:
        """The backend this model is registered with (ART's accessor); an error before `register`."""
        if self._backend is None:
            raise ArtValueError(f"model {self.name!r} is not registered: `await model.register(backend)` first")
        return self._backend

    # -- metrics and costs ----------------------------------------------------------------------
    @property
    def wandb_config(self) -> dict:
        """What `update_wandb_config` merged so far (the W&B run starts with it)."""
        return copy.deepcopy(self._wandb_config)

    def update_wandb_config(self, config: dict) -> None:
        """Merge `config` (nested dicts) into the W&B run's config, now if the run is open, else
        when it starts. A key given again with another value raises ValueError naming it."""
        merged = copy.deepcopy(self._wandb_config)
        _merge_config(merged, config, path="")
        self._wandb_config = merged
        update_wandb_config(self, copy.deepcopy(merged))

    def set_cost_calculator(self, calculator: CostCalculator | None) -> None:
        """Price completions made through `openai_client()` while a metrics builder is active
        (`art.costs.build_cost_calculator`); None stops it."""
        self._cost_calculator = calculator

    @property
    def cost_calculator(self) -> CostCalculator | None:
        return self._cost_calculator

    def metrics_builder(self, cost_context: str = "train") -> MetricsBuilder:
        """The builder for one split's step metrics (`costs/`, `data/`, `time/`); the next
        `log` of that split writes what it holds."""
        if self._builders is None:
            self._builders = SharedMetrics()
        return MetricsBuilder(cost_context, shared=self._builders)

    def activate_metrics_context(self, cost_context: str) -> contextvars.Token:
        """Make `metrics_builder(cost_context)` the active builder (ART's): API costs charged
        inside go to it, "eval" costs into the next `log(split="val")`. Undo with
        `token.var.reset(token)`."""
        return self.metrics_builder(cost_context).activate()

    async def _record_cost(self, response: httpx.Response) -> None:
        """httpx response hook of `openai_client()`: a whole (not streamed) chat completion or
        Responses answer made while a builder is active adds its cost, a chat prompt counted once
        per choice."""
        builder = active_builder()
        path = response.request.url.path
        if (
            builder is None
            or self._cost_calculator is None
            or response.status_code != 200
            or not path.endswith(("/chat/completions", "/responses"))
            or "json" not in response.headers.get("content-type", "")
        ):
            return
        await response.aread()
        try:
            body = json.loads(response.content)
            usage = body.get("usage") or {}
            if path.endswith("/responses"):  # one answer; Responses' names for the two counts
                prompt, completion = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
            else:
                prompt = int(usage.get("prompt_tokens") or 0) * max(1, len(body.get("choices") or []))
                completion = int(usage.get("completion_tokens") or 0)
            costs = self._cost_calculator(prompt, completion, builder.cost_context)
        except (ValueError, TypeError, AttributeError):
            return
        for key, usd in costs.items():
            builder.add_metric(key, usd)

    async def register(self, backend: ServiceBackend) -> None:
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
                "or pass inference_base_url",
                field="inference_base_url",
            )
        if self._client is None:
            # A backend that reaches its server through a custom transport supplies the client.
            http_client = (
                self._backend.openai_http_client(self) if self._backend is not None else None
            ) or DefaultAsyncHttpxClient(event_hooks={"request": [tracing.inject_headers]})
            hooks = http_client.event_hooks
            http_client.event_hooks = {**hooks, "response": [*hooks.get("response", []), self._record_cost]}
            self._client = AsyncOpenAI(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "none",
                timeout=httpx.Timeout(timeout=1800.0, connect=10.0),  # type: ignore[arg-type]  # see below
                max_retries=0,
                # openai's annotations name its httpx fork (httpx2); httpx's client and timeout work the same
                http_client=http_client,  # type: ignore[arg-type]
            )
        return self._client

    def get_inference_name(self, step: int | None = None) -> str:
        """The `model` field for requests: the latest weights, or those of `step`."""
        base = self.inference_model_name or self.name
        return base if step is None else f"{base}@{step}"

    async def get_step(self) -> int:
        """The model's latest step: the backend's answer once registered.

        Before `register`, a trainable model reads its run stored under `base_path` (the latest
        complete checkpoint, the step `register` resumes at; 0 for a run with none yet), and
        with no run stored there raises ArtValueError, as ART does: a silent 0 would pass for a
        fresh run (`LocalBackend(path=...)` sets `base_path` at `register`; a remote backend's
        runs live on its server). A plain `Model` has no steps: 0, as in ART."""
        if self._backend is not None:
            return await self._backend.get_step(self)
        if not self.trainable:
            return 0
        run = ModelDir(self.base_path, self.project, self.name)
        steps = await asyncio.to_thread(complete_steps, run.checkpoints)
        if steps:
            return steps[-1]
        if await asyncio.to_thread(run.model_json.is_file):
            return 0
        raise ArtValueError(
            f"model {self.name!r} is not registered and no run of it is stored under {str(run.path)!r}: "
            "`await model.register(backend)` first (or set base_path to the folder the run is stored in)",
            field="base_path",
        )

    async def log(
        self,
        trajectories: Iterable[Trajectory | TrajectoryGroup] | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> None:
        """Append a row to history.jsonl (and W&B) and write the step's trajectories.

        The row holds the trajectories' mean reward and metrics, what this split's metrics
        builder collected, and `metrics`, named by ART's taxonomy (art.metrics_taxonomy): keys
        of a known section (`reward/…`, `loss/…`, `costs/…`, `time/…`, `data/…`, …) as given,
        any other under `split/`. On "train" the groups' counts go under `data/step_*`, and
        `time/step_wall_s` is the time since the previous train row of this object (with the
        backend's `gpu_cost_per_hour_usd`, `costs/gpu` too). Running totals are added where
        the row is written."""
        validate_name(split, "split")
        groups = _as_groups(trajectories)
        row: dict[str, Any] = {}
        scenario_ids: list[str] = []
        if groups:
            summary = summarize(groups)
            if split == "train":
                del summary["num_groups"], summary["num_trajectories"]
                row.update(data_counts(groups))
                scenario_ids = group_scenario_ids(groups)
            row.update(route(summary, split))
        if self._builders is not None:
            built, ids = MetricsBuilder(split, shared=self._builders).take()
            row.update(built)
            scenario_ids += ids
        row.update(route(metrics or {}, split))
        if split == "train" and SFT_WANDB_GRADIENT_STEP_KEY not in row:  # not each SFT batch's row
            row.update(self._step_wall_time(row))
        if groups:
            row.setdefault("time/wall_clock_sec", time.time() - self._created)
        step = await self.get_step() if step is None else step
        if self._backend is not None:
            written = await self._backend.log(
                self, split=split, step=step, metrics=row, groups=groups, scenario_ids=scenario_ids
            )
        else:
            written = await asyncio.to_thread(
                write_log,
                ModelDir(self.base_path, self.project, self.name),
                split=split,
                step=step,
                metrics=row,
                groups=groups,
                scenario_ids=scenario_ids,
            )
        written = {k: v for k, v in (written or row).items() if k not in ("step", "split", "recorded_at")}
        log_to_wandb(self, step=step, metrics=written, run_dir=self._run_dir())

    def _step_wall_time(self, row: dict) -> dict[str, float]:
        now, began = time.monotonic(), self._last_train_log
        self._last_train_log = now
        if "time/step_wall_s" in row:
            return {}
        out = {"time/step_wall_s": now - began}
        rate = getattr(self._backend, "gpu_cost_per_hour_usd", None)
        if rate is not None and "costs/gpu" not in row:
            out["costs/gpu"] = out["time/step_wall_s"] * float(rate) / 3600.0
        return out

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


class TrainableModel(Model[ModelConfig, StateType], Generic[ModelConfig, StateType]):
    """The policy being trained: a LoRA adapter (by default) on `base_model`."""

    base_model: str
    trainable: bool = True
    run_name: str | None = None
    """ART's name for one training run of the model `name` (None: `name`). It may differ from
    `name`, as in ART, and labels the run; the run is stored and served under `name` here (its
    folder, `name` and `name@step` on the server), so two runs kept apart need two names."""
    lora_config: dict[str, Any] | None = None
    """The adapter's rank, alpha, dropout and target modules (ART's field, `art.dev.LoRAConfig`
    keys); the same as `_internal_config["lora_config"]`."""
    _internal_config: dict | None = PrivateAttr(default=None)

    def __init__(self, *, _internal_config: dict | None = None, **data: Any) -> None:
        super().__init__(**data)
        internal = dict(_internal_config) if _internal_config else {}
        if self.lora_config is not None:
            if internal.get("lora_config", self.lora_config) != self.lora_config:
                raise ArtValueError(
                    "lora_config and _internal_config['lora_config'] differ: give it once", field="lora_config"
                )
            internal["lora_config"] = dict(self.lora_config)
        self._internal_config = internal or None

    def model_post_init(self, __context: Any) -> None:
        super().model_post_init(__context)
        if self.run_name is None:
            self.run_name = self.name
        elif not isinstance(self.run_name, str) or not self.run_name.strip():
            raise ArtValueError(f"run_name must be a non-empty string, got {self.run_name!r}", field="run_name")

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
        with tracing.span(
            "art.train", {"art.model": f"{self.project}/{self.name}", "art.step_from": step, "art.groups": len(groups)}
        ):
            began = time.monotonic()
            result = await backend.train(self, groups, config=config, _config=_config)
            trainer_s = time.monotonic() - began
        metrics = route(result.metrics, "train")
        metrics["time/step_trainer_s"] = trainer_s
        if "trained_tokens" in result.metrics:
            metrics["data/step_trainer_tokens"] = result.metrics["trained_tokens"]
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
        rate schedule. Unless `log_metrics` is False, history gets one row per optimizer step
        (`sft/loss/train`, `sft/gradient_step`, ...) and a summary (`loss/train`, ...), all at the
        new step, as ART logs them (`art.training.sft_history`). (`verbose` is ART's; the
        backend's progress bar shows the batches.)"""
        backend = self._require_backend()
        step = await self.get_step()
        steps: list[dict] = []

        def on_event(event: dict) -> None:  # called from the training thread
            if event.get("type") == "gradient_step":
                steps.append(event.get("metrics") or {})

        started = time.monotonic()
        with tracing.span("art.train_sft", {"art.model": f"{self.project}/{self.name}", "art.step_from": step}):
            result = await backend.train_sft(self, trajectories, config=config, _config=_config, progress=on_event)
        rows = history_rows(steps, result.metrics, time.monotonic() - started) if log_metrics else []
        for row in rows:
            await self.log(split="train", metrics=row, step=result.step)

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Keep the latest checkpoint and the best by `best_checkpoint_metric`; delete the rest."""
        return await self._require_backend().delete_checkpoints(self, best_checkpoint_metric)

    def _require_backend(self) -> ServiceBackend:
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


def _merge_config(into: dict, new: dict, *, path: str) -> None:
    """Merge nested dicts; the same leaf given two values is a mistake, not an update."""
    for key, value in new.items():
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge_config(into[key], value, path=where)
        elif key in into and into[key] != value:
            raise ValueError(f"Conflicting value for {where!r}: {into[key]!r} was set before, now {value!r}")
        else:
            into[key] = copy.deepcopy(value)
