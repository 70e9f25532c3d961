"""The bodies of the management routes (`art.server.management`), the wire `art.RemoteBackend`
speaks: the requests and answers of registering, training, logging, checkpoints, replicas and
forks. Unlike an OpenAI-compatible body (`art.server.openai_schemas`), a management body
refuses unknown fields: a typo is named, not silently dropped.

The management routes:

    POST   /art/models                                    register a model (trainable or not)
    GET    /art/models                                    the models registered so far
    GET    /art/models/{project}/{name}/step              the latest step
    POST   /art/models/{project}/{name}/train             one update; NDJSON progress stream
    DELETE /art/models/{project}/{name}/train             cancel the running update (it rolls back)
    POST   /art/models/{project}/{name}/train_sft         supervised fine-tuning; the same NDJSON stream
    POST   /art/models/{project}/{name}/log               a history row and its trajectories
    GET    /art/models/{project}/{name}/checkpoints       the saved steps
    DELETE /art/models/{project}/{name}/checkpoints       keep the latest and the best step
    GET    /art/models/{project}/{name}/metrics           the history.jsonl rows
    POST   /art/models/{project}/{name}/replicas/restart  start engine replicas out of rotation again
    POST   /art/models/{project}/{name}/fork              start the model from another model's checkpoint

Trajectories travel as `Trajectory.for_logging()` dicts: a message is a dict with a `role`,
a model `Choice` is its full dump (`message`, `logprobs`, `token_ids`, `prompt_token_ids`),
revived into the same `Choice` class (`Trajectory.from_logging`), so training sees exactly
the ids the engine sampled. They travel once per step: a train body's `upload_id` (the
client's digest of its groups) lets the log call that follows (`model.train` logs what it
trained on) name them with `trajectory_groups_from`; the server holds each model's last train
groups for that.

The train stream (`application/x-ndjson`) is one `art.service.TrainEvent` per line:
`accepted` (the request is valid; `step`: the step it will write unless another update of the
model is queued first), one `gradient_step` per optimizer step (`step`, `done`, `total`,
`metrics`), `heartbeat` every few seconds while nothing else is said (keeps proxies and read
timeouts quiet), and last either `result` (`step`, `metrics`) or `error` (`error`: OpenAI's
error object plus its HTTP `status`). The body's `config`, `dev_config` and `options` are
resolved once, by `art.service.resolve_train_options`.
Input that can be checked up front (names, payload shape, training options) is refused
with an ordinary 4xx before the stream starts. The update runs as its own task: a client
that disconnects mid-step does not cancel it; the step completes and is checkpointed
atomically, and the client sees it on its next `get_step`, unless the body asked for
`cancel_on_disconnect`. `DELETE .../train` cancels a running step: it stops at its next
micro-batch, rolls back, and its stream ends with a 409 `step_cancelled` error line. A server
that shuts down abandons its running steps the same way; their streams end with a 503
`unavailable` error line naming the step the model stays at (send the step again later).

A train body may carry `expected_step`, the step the client believes it trains from. If the
model is elsewhere (usually: the same call already completed after its connection broke) the
answer is a 409 `step_conflict` and nothing is trained, so a retry never applies a batch twice.
The check is made again under the model's training lock, so two racing calls cannot both pass;
the loser then ends its stream with an `error` line carrying status 409.

After a restart (even `kill -9`) the server knows no registrations, but the runs are on disk:
a request that names a model with a `model.json` under the storage root registers it again
from that file (`LocalService.spec`), at its latest complete checkpoint, before answering.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from art.naming import MAX_METRIC_NAME, MAX_STEP
from art.storage.layout import validate_name
from art.trajectories import ExceptionRecord, MetadataValue, MetricValue, Trajectory, TrajectoryGroup
from art.types import TrainConfig, TrainSFTConfig


class _Strict(BaseModel):
    """Unknown fields are refused (a typo is named, not silently dropped)."""

    model_config = ConfigDict(extra="forbid")


def _field_name(info: ValidationInfo) -> str:
    """The field a field validator checks (pydantic names it to every field validator)."""
    if info.field_name is None:
        raise RuntimeError("a field validator ran without its field's name")
    return info.field_name


MAX_BASE_MODEL = 4096
"""A Hugging Face id or a path on the server: no longer than a path may be (Linux's PATH_MAX)."""


class RegisterRequest(_Strict):
    """`art.Model` / `art.TrainableModel` fields the server needs."""

    name: str = Field(description="Model name: 1-128 letters, digits, '.', '_' or '-'.")
    project: str = Field(description="Project name, same rules as `name`.")
    trainable: bool = Field(False, description="True for an `art.TrainableModel`.")
    base_model: str | None = Field(
        None,
        validate_default=True,
        max_length=MAX_BASE_MODEL,
        description="Hugging Face id or server-side path; required when trainable.",
    )
    config: Any = Field(None, description="The user's config object, stored with the run.")
    internal_config: dict[str, Any] | None = Field(
        None, description="`TrainableModel(_internal_config=...)`: engine_args, peft_args, seed."
    )
    inference_base_url: str | None = Field(
        None, description="A non-trainable model served elsewhere (a prompted baseline); only its logs live here."
    )
    inference_model_name: str | None = None

    @field_validator("name", "project")
    @classmethod
    def _valid_name(cls, value: str, info: ValidationInfo) -> str:
        return validate_name(value, _field_name(info))

    @field_validator("base_model")
    @classmethod
    def _base_model_if_trainable(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("trainable") and not value:
            raise ValueError("a trainable model needs a base_model")
        return value


class ModelInfo(BaseModel):
    project: str
    name: str
    trainable: bool
    base_model: str | None
    step: int = Field(description="The latest checkpoint (0 for a fresh or non-trainable model).")


class HistoryPayload(_Strict):
    messages_and_choices: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None


class TrajectoryPayload(_Strict):
    """`Trajectory.for_logging()`: messages are dicts with `role`; Choices are full dumps."""

    messages_and_choices: list[dict[str, Any]] = Field(
        [],
        description="Message dicts (with `role`) and dumped `Choice` objects (with `message`, "
        "`logprobs`, `token_ids`, `prompt_token_ids`).",
    )
    tools: list[dict[str, Any]] | None = None
    reward: float = Field(0.0, allow_inf_nan=False)
    metrics: dict[str, MetricValue] = {}
    metadata: dict[str, MetadataValue] = {}
    logs: list[str] = []
    additional_histories: list[HistoryPayload] = []
    start_time: datetime | None = None
    end_time: datetime | None = None
    initial_policy_version: int | None = Field(None, description="The step whose weights sampled its oldest turn.")
    final_policy_version: int | None = Field(None, description="The step whose weights sampled its newest turn.")

    def to_trajectory(self, where: str) -> Trajectory:
        return Trajectory.from_logging(
            self.model_dump(exclude={"start_time"} if self.start_time is None else set()), where
        )


class TrajectoryGroupPayload(_Strict):
    """`TrajectoryGroup.for_logging()`."""

    trajectories: list[TrajectoryPayload] = []
    exceptions: list[ExceptionRecord] = []
    metadata: dict[str, MetadataValue] = {}
    metrics: dict[str, MetricValue] = {}
    logs: list[str] = []

    def to_group(self, where: str) -> TrajectoryGroup:
        trajectories = [t.to_trajectory(f"{where}.trajectories[{i}]") for i, t in enumerate(self.trajectories)]
        return TrajectoryGroup(
            trajectories, exceptions=self.exceptions, metadata=self.metadata, metrics=self.metrics, logs=self.logs
        )


class TrainRequest(_Strict):
    """`backend.train(model, groups, config=..., _config=..., **options)` as JSON."""

    trajectory_groups: list[TrajectoryGroupPayload]
    config: TrainConfig | None = Field(None, description="`art.TrainConfig` (learning_rate, beta).")
    dev_config: dict[str, Any] = Field({}, description="`art.dev.TrainConfig` options (the `_config` argument).")
    options: dict[str, Any] = Field({}, description="Keyword options of `backend.train`; they override both.")
    expected_step: int | None = Field(
        None,
        ge=0,
        le=MAX_STEP,
        description="The step the client trains from; another step on the server gets a 409 "
        "(`step_conflict`) and trains nothing. None skips the check.",
    )
    cancel_on_disconnect: bool = Field(
        False, description="Cancel (and roll back) the step when the client disconnects; by default it completes."
    )
    upload_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="A name for these groups (the client's digest of them): the "
        "next log call may send it as `trajectory_groups_from` instead of the groups.",
    )


class TrainSFTRequest(_Strict):
    """`backend.train_sft(model, trajectories, config=..., _config=..., **options)` as JSON; the
    server renders the chats with the model's chat template (`art.training.chat_tokens`)."""

    trajectories: list[TrajectoryPayload] = Field(
        description="`Trajectory.for_logging()` dicts: messages with `role` (assistant turns are trained) and tools."
    )
    config: TrainSFTConfig | None = Field(
        None, description="`art.TrainSFTConfig` (learning_rate, batch_size, assistant_turns)."
    )
    dev_config: dict[str, Any] = Field({}, description="`art.dev.TrainSFTConfig` options (the `_config` argument).")
    options: dict[str, Any] = Field({}, description="Keyword options of `backend.train_sft`; they override both.")
    expected_step: int | None = Field(None, ge=0, le=MAX_STEP, description="As for `train`.")
    cancel_on_disconnect: bool = Field(False, description="As for `train`.")


class LogRequest(_Strict):
    """`model.log(...)` after the client has summarised it: the history row and the groups."""

    split: str
    step: int = Field(ge=0, le=MAX_STEP)
    metrics: dict[str, float | int | bool | str | None] = {}
    trajectory_groups: list[TrajectoryGroupPayload] = []
    scenario_ids: list[Annotated[str, Field(max_length=MAX_METRIC_NAME)]] = Field(
        [], max_length=100_000, description="The step's scenarios, for `data/cum/num_unique_scenarios`."
    )
    trajectory_groups_from: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="The `upload_id` of this model's last train call: log the "
        "groups it uploaded without sending them again. A 400 naming this field when the server no longer holds "
        "them (send `trajectory_groups` then).",
    )

    @field_validator("split")
    @classmethod
    def _valid_split(cls, value: str) -> str:
        return validate_name(value, "split")


class Logged(BaseModel):
    split: str
    step: int
    trajectories: int
    row: dict = Field({}, description="The history row as written, with the running totals it derived.")


class StepInfo(BaseModel):
    step: int


class Checkpoints(BaseModel):
    steps: list[int]
    latest: int


class Cancelled(BaseModel):
    cancelled: bool = Field(
        description="True when a running step was told to stop; it rolls back and its "
        "train stream ends with a 409 `step_cancelled` error line."
    )


class ForkRequest(_Strict):
    """`backend.fork_checkpoint(model, from_model, from_project, not_after_step)` as JSON; the
    model's own fields say what it is when it is not registered yet."""

    from_model: str = Field(description="The model whose checkpoint is copied; its run is stored on this server.")
    from_project: str = Field(description="Its project.")
    not_after_step: int | None = Field(
        None, ge=0, le=MAX_STEP, description="Copy the last checkpoint at or before this step (None: the latest)."
    )
    base_model: str = Field(
        max_length=MAX_BASE_MODEL, description="The forked model's base model; it must be the source's."
    )
    config: Any = Field(None, description="The forked model's config object, stored with its run.")
    internal_config: dict[str, Any] | None = Field(None, description="Its `TrainableModel(_internal_config=...)`.")

    @field_validator("from_model", "from_project")
    @classmethod
    def _valid_name(cls, value: str, info: ValidationInfo) -> str:
        return validate_name(value, _field_name(info))


class Forked(BaseModel):
    step: int = Field(
        description="The forked model's step now: the source step copied (or, for a fork made "
        "before, the step it has trained to since)."
    )


class RestartedReplicas(BaseModel):
    restarted: list[int] = Field(description="Indices of the replicas started again, on the current weights.")


class DeletedCheckpoints(BaseModel):
    deleted: list[int]
    kept: list[int]
