"""Management routes: what `art.RemoteBackend` calls to register, train and log models.

They sit beside the OpenAI routes (`art.server.app`) in the app that `art serve` runs, and
hold no model state: every call goes to the `LocalBackend` living in the server process,
through the same protocol `art.Model` uses in process (register, _get_step, train, _log,
_delete_checkpoints, ...). This module only turns JSON into those calls and back.

    POST   /art/models                                    register a model (trainable or not)
    GET    /art/models                                    the models registered so far
    GET    /art/models/{project}/{name}/step              the latest step
    POST   /art/models/{project}/{name}/train             one update; NDJSON progress stream
    POST   /art/models/{project}/{name}/log               a history row and its trajectories
    GET    /art/models/{project}/{name}/checkpoints       the saved steps
    DELETE /art/models/{project}/{name}/checkpoints       keep the latest and the best step
    GET    /art/models/{project}/{name}/metrics           the history.jsonl rows

Trajectories travel as `Trajectory.for_logging()` dicts: a message is a dict with a `role`,
a model `Choice` is its full dump (`message`, `logprobs`, `token_ids`, `prompt_token_ids`),
revived here into the same `Choice` class, so training sees exactly the ids the engine sampled.

The train stream (`application/x-ndjson`) is one JSON object per line, each with a `type`:
`accepted` (the request is valid; `step`: the step it will write unless another update of the
model is queued first), one `gradient_step` per optimizer step (`step`, `done`, `total`,
`metrics`), `heartbeat` every few seconds
while nothing else is said (keeps proxies and read timeouts quiet), and last either `result`
(`step`, `metrics`) or `error` (`error`: OpenAI's error object plus its HTTP `status`).
Input that can be checked up front (names, payload shape, training options) is refused
with an ordinary 4xx before the stream starts. The update runs as its own task: a client
that disconnects mid-step does not cancel it; the step completes and is checkpointed
atomically, and the client sees it on its next `get_step`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from datetime import datetime
from typing import Any, Literal, Union

from fastapi import APIRouter, Depends, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from art.errors import (ArtError, ArtValueError, BackendError, ContextLengthError, ModelNotFoundError,
                        TrajectoryError)
from art.model import Model, TrainableModel
from art.storage.layout import validate_name
from art.trajectories import ExceptionRecord, Trajectory, TrajectoryGroup
from art.types import TrainConfig

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
        data = self.model_dump(exclude={"start_time"} if self.start_time is None else set())
        data["messages_and_choices"] = _revive(self.messages_and_choices, f"{where}.messages_and_choices")
        data["additional_histories"] = [
            {**h, "messages_and_choices": _revive(h["messages_and_choices"],
                                                  f"{where}.additional_histories[{i}].messages_and_choices")}
            for i, h in enumerate(data["additional_histories"])
        ]
        try:
            return Trajectory.model_validate(data)
        except ValidationError as exc:
            raise _named(exc, where) from None


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


class LogRequest(_Strict):
    """`model.log(...)` after the client has summarised it: the history row and the groups."""

    split: str
    step: int = Field(ge=0)
    metrics: dict[str, Union[float, int, bool, str, None]] = {}
    trajectory_groups: list[TrajectoryGroupPayload] = []

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


class DeletedCheckpoints(BaseModel):
    deleted: list[int]
    kept: list[int]


class TrainEvent(BaseModel):
    """One line of the train stream (documentation only; see the module docstring)."""

    type: Literal["accepted", "gradient_step", "heartbeat", "result", "error"]
    step: int | None = None
    done: int | None = None
    total: int | None = None
    metrics: dict[str, float] | None = None
    error: dict[str, Any] | None = None


# -- conversion helpers ------------------------------------------------------------------


def _revive(items: list[dict[str, Any]], where: str) -> list[Any]:
    """Dumped Choices (a `message`, no `role`) become `Choice` objects again, extras included."""
    out: list[Any] = []
    for i, item in enumerate(items):
        if "role" not in item and "message" in item:
            try:
                out.append(Choice.model_validate(item))
            except ValidationError as exc:
                raise _named(exc, f"{where}[{i}]") from None
        else:
            out.append(item)
    return out


def _named(exc: ValidationError, where: str) -> TrajectoryError:
    first = exc.errors()[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first.get("loc", ()))
    return TrajectoryError(f"{where}{loc}: {first.get('msg', 'invalid')}", field=f"{where}{loc}")


def error_object(exc: BaseException) -> dict[str, Any]:
    """OpenAI's error object for `exc`, with the HTTP status the app would answer it with."""
    if isinstance(exc, ModelNotFoundError):
        status, kind, param, code = 404, "invalid_request_error", "model", "model_not_found"
    elif isinstance(exc, ArtValueError):
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        status, kind, param = 400, "invalid_request_error", exc.field
    elif isinstance(exc, ArtError):
        status, kind, param, code = 500, "server_error", None, None
    else:
        return {"message": f"internal error: {type(exc).__name__}: {exc}", "type": "server_error",
                "param": None, "code": None, "status": 500}
    return {"message": str(exc), "type": kind, "param": param, "code": code, "status": status}


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
            log.exception("management request failed")
            body = error_object(exc)
            return JSONResponse({"error": {k: v for k, v in body.items() if k != "status"}}, status_code=500)

    return wrapper


class _ModelRef:
    """A model known only by its names (logs of a model this server never registered)."""

    trainable = False

    def __init__(self, project: str, name: str) -> None:
        self.project, self.name = project, name


def model_key(project: str, name: str) -> tuple[str, str]:
    """Path parameters, checked like every stored name (no separators, no traversal)."""
    return validate_name(project, "project"), validate_name(name, "name")


# -- the routes ------------------------------------------------------------------------------


def management_router(backend, *, heartbeat_s: float = 10.0) -> APIRouter:
    """Routes under `/art` backed by `backend` (a `LocalBackend` in this process)."""
    router = APIRouter(prefix="/art", tags=["management"])
    models: dict[tuple[str, str], Model] = {}
    register_locks: dict[tuple[str, str], asyncio.Lock] = {}
    running: set[asyncio.Task] = set()  # train tasks outlive their requests; keep them referenced

    def registered(key: tuple[str, str]) -> Model:
        model = models.get(key)
        if model is None:
            raise ModelNotFoundError(
                f"model {key[0]}/{key[1]} is not registered on this server (it may have restarted): "
                "call `await model.register(backend)` again")
        return model

    def trainable(key: tuple[str, str]) -> TrainableModel:
        model = registered(key)
        if not getattr(model, "trainable", False):
            raise ArtValueError(f"model {key[0]}/{key[1]} was registered as not trainable", field="trainable")
        return model

    async def info(model) -> ModelInfo:
        return ModelInfo(project=model.project, name=model.name, trainable=model.trainable,
                         base_model=getattr(model, "base_model", None), step=await backend._get_step(model))

    @router.post("/models", response_model=ModelInfo, summary="Register a model")
    @_answer_errors
    async def register(body: RegisterRequest) -> ModelInfo:
        key = (body.project, body.name)
        async with register_locks.setdefault(key, asyncio.Lock()):  # one load per model
            common = dict(name=body.name, project=body.project, config=body.config)
            if body.trainable:
                model = TrainableModel(base_model=body.base_model, _internal_config=body.internal_config, **common)
            else:
                model = Model(inference_base_url=body.inference_base_url,
                              inference_model_name=body.inference_model_name, **common)
            try:
                await backend.register(model)
            except OSError as exc:  # mostly transformers' "no such model": name what was asked for
                raise ArtValueError(f"registering {body.project}/{body.name} failed on the server; check "
                                    f"base_model {body.base_model!r}: {exc}", field="base_model") from exc
            models[key] = model
            return await info(model)

    @router.get("/models", response_model=list[ModelInfo], summary="List registered models")
    @_answer_errors
    async def list_models() -> list[ModelInfo]:
        return [await info(model) for model in list(models.values())]

    @router.get("/models/{project}/{name}/step", response_model=StepInfo, summary="Latest step")
    @_answer_errors
    async def get_step(key: tuple[str, str] = Depends(model_key)) -> StepInfo:
        model = models.get(key) or _ModelRef(*key)
        return StepInfo(step=await backend._get_step(model))

    @router.post(
        "/models/{project}/{name}/train",
        summary="Train one step (streams NDJSON progress)",
        response_class=StreamingResponse,
        responses={200: {"description": "One JSON object per line; see `TrainEvent`.",
                         "content": {"application/x-ndjson": {"schema": TrainEvent.model_json_schema()}}}},
    )
    @_answer_errors
    async def train(body: TrainRequest, key: tuple[str, str] = Depends(model_key)) -> StreamingResponse:
        from art.training.options import TrainOptions  # server side only: it brings torch

        model = trainable(key)
        groups = await asyncio.to_thread(_groups, body.trajectory_groups)  # CPU work off the event loop
        config = body.config.model_dump() if body.config else {}
        TrainOptions.build(None, {**config, **body.dev_config, **body.options})  # 400 before streaming
        step = await backend._get_step(model) + 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def progress(event: dict[str, Any]) -> None:  # called from the training thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        task = asyncio.ensure_future(backend.train(model, groups, config=body.config, _config=body.dev_config,
                                                   progress=progress, **body.options))
        running.add(task)

        def finished(task: asyncio.Task) -> None:
            running.discard(task)
            queue.put_nowait(None)
            _report(task, key)

        task.add_done_callback(finished)
        started = time.monotonic()

        async def lines():
            yield _line({"type": "accepted", "step": step, "groups": len(groups),
                         "trajectories": sum(len(g.trajectories) for g in groups)})
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
                cancelled = BackendError("the step was cancelled (server shutdown)")
                yield _line({"type": "error", "error": error_object(cancelled)})
            elif task.exception() is not None:
                yield _line({"type": "error", "error": error_object(task.exception())})
            else:
                result = task.result()
                yield _line({"type": "result", "step": result.step, "metrics": result.metrics})

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @router.post("/models/{project}/{name}/log", response_model=Logged, summary="Log metrics and trajectories")
    @_answer_errors
    async def log_route(body: LogRequest, key: tuple[str, str] = Depends(model_key)) -> Logged:
        model = models.get(key) or _ModelRef(*key)
        groups = await asyncio.to_thread(_groups, body.trajectory_groups)
        await backend._log(model, split=body.split, step=body.step, metrics=body.metrics, groups=groups)
        return Logged(split=body.split, step=body.step, trajectories=sum(len(g.trajectories) for g in groups))

    @router.get("/models/{project}/{name}/checkpoints", response_model=Checkpoints, summary="Saved steps")
    @_answer_errors
    async def list_checkpoints(key: tuple[str, str] = Depends(model_key)) -> Checkpoints:
        model = trainable(key)
        return Checkpoints(steps=await backend._list_checkpoints(model), latest=await backend._get_step(model))

    @router.delete("/models/{project}/{name}/checkpoints", response_model=DeletedCheckpoints,
                   summary="Keep the latest and the best step; delete the rest")
    @_answer_errors
    async def delete_checkpoints(
        key: tuple[str, str] = Depends(model_key),
        best_checkpoint_metric: str = Query("val/reward", description="History metric whose best step is kept."),
    ) -> DeletedCheckpoints:
        model = trainable(key)
        deleted = await backend._delete_checkpoints(model, best_checkpoint_metric)
        return DeletedCheckpoints(deleted=deleted, kept=await backend._list_checkpoints(model))

    @router.get("/models/{project}/{name}/metrics", summary="History rows (history.jsonl)",
                responses={200: {"description": "`{\"rows\": [...]}`, oldest first"}})
    @_answer_errors
    async def metrics(key: tuple[str, str] = Depends(model_key),
                      split: str | None = Query(None, description="Only rows logged for this split.")) -> Response:
        rows = await backend._get_history(models.get(key) or _ModelRef(*key))
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
