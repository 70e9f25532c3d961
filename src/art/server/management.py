"""Management routes: what `art.RemoteBackend` calls to register, train and log models.

They sit beside the OpenAI routes (`art.server.app`) in the app that `art serve` runs, and
hold no model state: every call goes to the `LocalService` living in the server process,
through the service API (`art.service`) that `LocalBackend` also adapts in process, and
`art.RemoteService` speaks from the other side. This module only turns JSON into those calls
and back.

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
micro-batch, rolls back, and its stream ends with a 409 `step_cancelled` error line.

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

import asyncio
import functools
import json
import logging
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Union

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from art.errors import ArtError, ArtValueError, BackendUnavailableError, StepConflictError
from art.naming import MAX_METRIC_NAME, MAX_STEP, echo
from art.observability import tracing
from art.server.app import error_object, error_response
from art.server.security import check_base_model
from art.service import ModelKey, ModelSpec, TrainEvent, resolve_train_options
from art.training.sft_options import resolve_sft_options
from art.storage.layout import validate_name
from art.trajectories import ExceptionRecord, Trajectory, TrajectoryGroup
from art.types import TrainConfig, TrainSFTConfig

if TYPE_CHECKING:
    from art.service.local import LocalService

log = logging.getLogger(__name__)

MetricValue = Union[float, int, bool]
MetadataValue = Union[float, int, str, bool, None]


# -- request and response bodies ---------------------------------------------------------


class _Strict(BaseModel):
    """Unknown fields are refused (a typo is named, not silently dropped)."""

    model_config = ConfigDict(extra="forbid")


class RegisterRequest(_Strict):
    """`art.Model` / `art.TrainableModel` fields the server needs."""

    name: str = Field(description="Model name: 1-128 letters, digits, '.', '_' or '-'.")
    project: str = Field(description="Project name, same rules as `name`.")
    trainable: bool = Field(False, description="True for an `art.TrainableModel`.")
    base_model: str | None = Field(None, validate_default=True,
                                   description="Hugging Face id or server-side path; required when trainable.")
    config: Any = Field(None, description="The user's config object, stored with the run.")
    internal_config: dict[str, Any] | None = Field(
        None, description="`TrainableModel(_internal_config=...)`: engine_args, peft_args, seed.")
    inference_base_url: str | None = Field(
        None, description="A non-trainable model served elsewhere (a prompted baseline); only its logs live here.")
    inference_model_name: str | None = None

    @field_validator("name", "project")
    @classmethod
    def _valid_name(cls, value: str, info: ValidationInfo) -> str:
        return validate_name(value, info.field_name)

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
        [], description="Message dicts (with `role`) and dumped `Choice` objects (with `message`, "
                        "`logprobs`, `token_ids`, `prompt_token_ids`).")
    tools: list[dict[str, Any]] | None = None
    reward: float = Field(0.0, allow_inf_nan=False)
    metrics: dict[str, MetricValue] = {}
    metadata: dict[str, MetadataValue] = {}
    logs: list[str] = []
    additional_histories: list[HistoryPayload] = []
    start_time: datetime | None = None
    end_time: datetime | None = None

    def to_trajectory(self, where: str) -> Trajectory:
        return Trajectory.from_logging(self.model_dump(exclude={"start_time"} if self.start_time is None else set()),
                                       where)


class TrajectoryGroupPayload(_Strict):
    """`TrajectoryGroup.for_logging()`."""

    trajectories: list[TrajectoryPayload] = []
    exceptions: list[ExceptionRecord] = []
    metadata: dict[str, MetadataValue] = {}
    metrics: dict[str, MetricValue] = {}
    logs: list[str] = []

    def to_group(self, where: str) -> TrajectoryGroup:
        trajectories = [t.to_trajectory(f"{where}.trajectories[{i}]") for i, t in enumerate(self.trajectories)]
        return TrajectoryGroup(trajectories, exceptions=self.exceptions, metadata=self.metadata,
                               metrics=self.metrics, logs=self.logs)


def _groups(payloads: list[TrajectoryGroupPayload]) -> list[TrajectoryGroup]:
    return [g.to_group(f"trajectory_groups[{i}]") for i, g in enumerate(payloads)]


class TrainRequest(_Strict):
    """`backend.train(model, groups, config=..., _config=..., **options)` as JSON."""

    trajectory_groups: list[TrajectoryGroupPayload]
    config: TrainConfig | None = Field(None, description="`art.TrainConfig` (learning_rate, beta).")
    dev_config: dict[str, Any] = Field({}, description="`art.dev.TrainConfig` options (the `_config` argument).")
    options: dict[str, Any] = Field({}, description="Keyword options of `backend.train`; they override both.")
    expected_step: int | None = Field(
        None, ge=0, le=MAX_STEP, description="The step the client trains from; another step on the server gets a 409 "
                                "(`step_conflict`) and trains nothing. None skips the check.")
    cancel_on_disconnect: bool = Field(
        False, description="Cancel (and roll back) the step when the client disconnects; by default it completes.")
    upload_id: str | None = Field(
        None, min_length=1, max_length=128, description="A name for these groups (the client's digest of them): the "
        "next log call may send it as `trajectory_groups_from` instead of the groups.")


class TrainSFTRequest(_Strict):
    """`backend.train_sft(model, trajectories, config=..., _config=..., **options)` as JSON; the
    server renders the chats with the model's chat template (`art.training.chat_tokens`)."""

    trajectories: list[TrajectoryPayload] = Field(
        description="`Trajectory.for_logging()` dicts: messages with `role` (assistant turns are trained) and tools.")
    config: TrainSFTConfig | None = Field(None, description="`art.TrainSFTConfig` (learning_rate, batch_size, "
                                                              "assistant_turns).")
    dev_config: dict[str, Any] = Field({}, description="`art.dev.TrainSFTConfig` options (the `_config` argument).")
    options: dict[str, Any] = Field({}, description="Keyword options of `backend.train_sft`; they override both.")
    expected_step: int | None = Field(None, ge=0, le=MAX_STEP, description="As for `train`.")
    cancel_on_disconnect: bool = Field(False, description="As for `train`.")


class LogRequest(_Strict):
    """`model.log(...)` after the client has summarised it: the history row and the groups."""

    split: str
    step: int = Field(ge=0, le=MAX_STEP)
    metrics: dict[str, Union[float, int, bool, str, None]] = {}
    trajectory_groups: list[TrajectoryGroupPayload] = []
    trajectory_groups_from: str | None = Field(
        None, min_length=1, max_length=128, description="The `upload_id` of this model's last train call: log the "
        "groups it uploaded without sending them again. A 400 naming this field when the server no longer holds "
        "them (send `trajectory_groups` then).")

    @field_validator("split")
    @classmethod
    def _valid_split(cls, value: str) -> str:
        return validate_name(value, "split")


class Logged(BaseModel):
    split: str
    step: int
    trajectories: int


class StepInfo(BaseModel):
    step: int


class Checkpoints(BaseModel):
    steps: list[int]
    latest: int


class Cancelled(BaseModel):
    cancelled: bool = Field(description="True when a running step was told to stop; it rolls back and its "
                                        "train stream ends with a 409 `step_cancelled` error line.")


class ForkRequest(_Strict):
    """`backend.fork_checkpoint(model, from_model, from_project, not_after_step)` as JSON; the
    model's own fields say what it is when it is not registered yet."""

    from_model: str = Field(description="The model whose checkpoint is copied; its run is stored on this server.")
    from_project: str = Field(description="Its project.")
    not_after_step: int | None = Field(None, ge=0, le=MAX_STEP,
                                       description="Copy the last checkpoint at or before this step (None: the latest).")
    base_model: str = Field(description="The forked model's base model; it must be the source's.")
    config: Any = Field(None, description="The forked model's config object, stored with its run.")
    internal_config: dict[str, Any] | None = Field(None, description="Its `TrainableModel(_internal_config=...)`.")

    @field_validator("from_model", "from_project")
    @classmethod
    def _valid_name(cls, value: str, info: ValidationInfo) -> str:
        return validate_name(value, info.field_name)


class Forked(BaseModel):
    step: int = Field(description="The forked model's step now: the source step copied (or, for a fork made "
                                  "before, the step it has trained to since).")


class RestartedReplicas(BaseModel):
    restarted: list[int] = Field(description="Indices of the replicas started again, on the current weights.")


class DeletedCheckpoints(BaseModel):
    deleted: list[int]
    kept: list[int]


# -- conversion helpers ------------------------------------------------------------------


def _line(event: dict[str, Any]) -> bytes:
    # Python's json: a diverged loss arrives as NaN rather than failing the whole stream.
    return (json.dumps(event, default=str) + "\n").encode()


def _json(content: Any) -> Response:
    """Like JSONResponse, but NaN metrics (from history) do not fail the response."""
    return Response(json.dumps(content, default=str), media_type="application/json")


def _answer_errors(route):
    """Unexpected failures become a logged 500 in OpenAI's shape, never a re-raise."""

    @functools.wraps(route)
    async def wrapper(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except (ArtError, StarletteHTTPException, RequestValidationError):
            raise  # the app's handlers map these
        except Exception as exc:
            return error_response(error_object(exc, f"management route {route.__name__}"))

    return wrapper


TRAIN_EVENT_SCHEMA = TypeAdapter(TrainEvent).json_schema()


def model_key(project: str, name: str) -> ModelKey:
    """Path parameters, checked like every stored name (no separators, no traversal)."""
    return validate_name(project, "project"), validate_name(name, "name")


# -- the routes ------------------------------------------------------------------------------


def management_router(service: LocalService, *, heartbeat_s: float = 10.0,
                      model_roots: list | None = None) -> APIRouter:
    """Routes under `/art` over `service`. `model_roots`: the server folders a registered
    `base_model` path may point into (None: any)."""
    router = APIRouter(prefix="/art", tags=["management"])
    running: set[asyncio.Task] = set()  # train tasks outlive their requests; keep them referenced
    uploads: dict[ModelKey, tuple[str, list[TrajectoryGroup]]] = {}  # each model's last train groups, for its log

    async def info(spec: ModelSpec) -> ModelInfo:
        return ModelInfo(project=spec.project, name=spec.name, trainable=spec.trainable,
                         base_model=spec.base_model, step=await service.step(spec.key))

    @router.post("/models", response_model=ModelInfo, summary="Register a model")
    @_answer_errors
    async def register(body: RegisterRequest) -> ModelInfo:
        if body.base_model is not None:
            check_base_model(body.base_model, model_roots)
        spec = ModelSpec(**body.model_dump())
        await service.register(spec)
        return await info(spec)

    @router.get("/models", response_model=list[ModelInfo], summary="List registered models")
    @_answer_errors
    async def list_models() -> list[ModelInfo]:
        return [await info(spec) for spec in await service.specs()]

    @router.get("/models/{project}/{name}/step", response_model=StepInfo, summary="Latest step")
    @_answer_errors
    async def get_step(key: ModelKey = Depends(model_key)) -> StepInfo:
        return StepInfo(step=await service.step(key))

    @router.post(
        "/models/{project}/{name}/train",
        summary="Train one step (streams NDJSON progress)",
        response_class=StreamingResponse,
        responses={200: {"description": "One JSON object per line; see `TrainEvent`.",
                         "content": {"application/x-ndjson": {"schema": TRAIN_EVENT_SCHEMA}}}},
    )
    @_answer_errors
    async def train(body: TrainRequest, request: Request, key: ModelKey = Depends(model_key)) -> StreamingResponse:
        options = resolve_train_options(body.config, body.dev_config, body.options)  # a 400 naming where
        groups = await asyncio.to_thread(_groups, body.trajectory_groups)  # CPU work off the event loop
        await service.check_training_input(key, groups)  # malformed trajectories: a 400, not a stream error
        uploads.pop(key, None)
        if body.upload_id is not None:  # `model.train` logs these next: they need not travel twice
            uploads[key] = (body.upload_id, groups)
        accepted = {"groups": len(groups), "trajectories": sum(len(g.trajectories) for g in groups)}

        def run(progress):
            return service.train(key, groups, options, expected_step=body.expected_step, progress=progress)

        return await stream_update(key, body, request, accepted, run)

    @router.post(
        "/models/{project}/{name}/train_sft",
        summary="Supervised fine-tuning, one checkpoint (streams NDJSON progress)",
        response_class=StreamingResponse,
        responses={200: {"description": "One JSON object per line; see `TrainEvent` (one `gradient_step` per batch).",
                         "content": {"application/x-ndjson": {"schema": TRAIN_EVENT_SCHEMA}}}},
    )
    @_answer_errors
    async def train_sft(body: TrainSFTRequest, request: Request,
                        key: ModelKey = Depends(model_key)) -> StreamingResponse:
        options = resolve_sft_options(body.config, body.dev_config, body.options)  # a 400 naming where
        trajectories = await asyncio.to_thread(
            lambda: [t.to_trajectory(f"trajectories[{i}]") for i, t in enumerate(body.trajectories)])

        def run(progress):
            return service.train_sft(key, trajectories, options, expected_step=body.expected_step, progress=progress)

        return await stream_update(key, body, request, {"trajectories": len(trajectories)}, run)

    async def stream_update(key: ModelKey, body, request: Request, accepted: dict, run) -> StreamingResponse:
        """Start `run(progress)` (a service update) as its own task and stream its TrainEvents."""
        current = await service.step(key)
        if body.expected_step is not None and body.expected_step != current:
            raise StepConflictError.between(f"{key[0]}/{key[1]}", body.expected_step, current)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TrainEvent | None] = asyncio.Queue()

        def progress(event: TrainEvent) -> None:  # called from the training thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        caller = tracing.extract_context(request.headers)  # the client's trace continues in the step

        async def train_step():
            with tracing.span("art.train_request", {"art.model": f"{key[0]}/{key[1]}"}, kind="SERVER",
                              context=caller):
                return await run(progress)

        task = asyncio.ensure_future(train_step())
        running.add(task)

        def finished(task: asyncio.Task) -> None:
            running.discard(task)
            queue.put_nowait(None)
            _report(task, key)

        task.add_done_callback(finished)
        started = time.monotonic()

        async def lines():
            try:
                async for line in events():
                    yield line
            finally:  # the generator ends early when the client disconnects
                if body.cancel_on_disconnect and not task.done():
                    log.warning("client of %s/%s left: cancelling its training step", *key)
                    await service.cancel_training(key)

        async def events():
            yield _line({"type": "accepted", "step": current + 1, **accepted})
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), heartbeat_s)
                except asyncio.TimeoutError:
                    yield _line({"type": "heartbeat", "elapsed_s": round(time.monotonic() - started, 1)})
                    continue
                if event is None:
                    break
                yield _line(event)
            if task.cancelled():
                cancelled = BackendUnavailableError("the step was cancelled (server shutdown)")
                yield _line({"type": "error", "error": error_object(cancelled)})
            elif task.exception() is not None:
                yield _line({"type": "error", "error": error_object(task.exception())})
            else:
                result = task.result()
                yield _line({"type": "result", "step": result.step, "metrics": result.metrics})

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @router.delete("/models/{project}/{name}/train", response_model=Cancelled,
                   summary="Cancel the running training step (it rolls back)")
    @_answer_errors
    async def cancel(key: ModelKey = Depends(model_key)) -> Cancelled:
        return Cancelled(cancelled=await service.cancel_training(key))

    @router.post("/models/{project}/{name}/log", response_model=Logged, summary="Log metrics and trajectories")
    @_answer_errors
    async def log_route(body: LogRequest, key: ModelKey = Depends(model_key)) -> Logged:
        if body.trajectory_groups_from is None:
            groups = await asyncio.to_thread(_groups, body.trajectory_groups)
        elif body.trajectory_groups:
            raise ArtValueError("send trajectory_groups or trajectory_groups_from, not both",
                                field="trajectory_groups_from")
        else:
            upload_id, groups = uploads.get(key, (None, []))
            if upload_id != body.trajectory_groups_from:
                raise ArtValueError(f"no train upload {echo(body.trajectory_groups_from)} of {key[0]}/{key[1]} is held "
                                    "here (another train call replaced it, or the server restarted): send "
                                    "trajectory_groups", field="trajectory_groups_from")
            del uploads[key]
        await service.log(key, split=body.split, step=body.step, metrics=body.metrics, groups=groups)
        return Logged(split=body.split, step=body.step, trajectories=sum(len(g.trajectories) for g in groups))

    @router.get("/models/{project}/{name}/checkpoints", response_model=Checkpoints, summary="Saved steps")
    @_answer_errors
    async def list_checkpoints(key: ModelKey = Depends(model_key)) -> Checkpoints:
        return Checkpoints(steps=await service.checkpoints(key), latest=await service.step(key))

    @router.delete("/models/{project}/{name}/checkpoints", response_model=DeletedCheckpoints,
                   summary="Keep the latest and the best step; delete the rest")
    @_answer_errors
    async def delete_checkpoints(
        key: ModelKey = Depends(model_key),
        best_checkpoint_metric: str = Query("val/reward", min_length=1, max_length=MAX_METRIC_NAME,
                                           description="History metric whose best step is kept."),
    ) -> DeletedCheckpoints:
        deleted = await service.delete_checkpoints(key, best_checkpoint_metric)
        return DeletedCheckpoints(deleted=deleted, kept=await service.checkpoints(key))

    @router.post("/models/{project}/{name}/replicas/restart", response_model=RestartedReplicas,
                 summary="Start the engine replicas that left the rotation again")
    @_answer_errors
    async def restart_replicas(key: ModelKey = Depends(model_key)) -> RestartedReplicas:
        return RestartedReplicas(restarted=await service.restart_replicas(key))

    @router.post("/models/{project}/{name}/fork", response_model=Forked,
                 summary="Start the model from another model's checkpoint")
    @_answer_errors
    async def fork(body: ForkRequest, key: ModelKey = Depends(model_key)) -> Forked:
        check_base_model(body.base_model, model_roots)
        spec = ModelSpec(project=key[0], name=key[1], trainable=True, base_model=body.base_model, config=body.config,
                         internal_config=body.internal_config)
        step = await service.fork_checkpoint(spec, (body.from_project, body.from_model),
                                             not_after_step=body.not_after_step)
        return Forked(step=step)

    @router.get("/models/{project}/{name}/metrics", summary="History rows (history.jsonl)",
                responses={200: {"description": "`{\"rows\": [...]}`, oldest first"}})
    @_answer_errors
    async def metrics(key: ModelKey = Depends(model_key),
                      split: str | None = Query(None, description="Only rows logged for this split.")) -> Response:
        rows = await service.history(key)
        if split is not None:
            rows = [row for row in rows if row.get("split") == split]
        return _json({"rows": rows})

    return router


def _report(task: asyncio.Task, key: tuple[str, str]) -> None:
    """Log how a train task ended (its client may be gone; this also retrieves the exception)."""
    if task.cancelled():
        log.warning("training of %s/%s was cancelled", *key)
    elif task.exception() is not None:
        log.warning("training of %s/%s failed: %s", *key, task.exception())
    else:
        log.info("%s/%s trained to step %d", *key, task.result().step)
