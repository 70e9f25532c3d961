"""Management routes: what `art.RemoteBackend` calls to register, train and log models.

They sit beside the OpenAI routes (`art.server.app`) in the app that `art serve` runs, and
hold no model state: every call goes to the `LocalBackend` living in the server process,
through the same protocol `art.Model` uses in process (register, _get_step, train, _log,
_delete_checkpoints, ...). This module only turns JSON into those calls and back.

    POST   /art/models                                    register a model (trainable or not)
    GET    /art/models                                    the models registered so far
    GET    /art/models/{project}/{name}/step              the latest step
    POST   /art/models/{project}/{name}/train             one update; NDJSON progress stream
    DELETE /art/models/{project}/{name}/train             cancel the running update (it rolls back)
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
from that file (`Registrations.recover`), at its latest complete checkpoint, before answering.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from datetime import datetime
from typing import Any, Literal, Union

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from art.errors import (ArtError, ArtValueError, BackendError, BackendUnavailableError, ModelNotFoundError,
                        StepConflictError, TrajectoryError)
from art.model import Model, TrainableModel
from art.naming import MAX_METRIC_NAME, MAX_STEP, echo
from art.observability import tracing
from art.server.app import error_object, error_response
from art.server.security import check_base_model
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
    expected_step: int | None = Field(
        None, ge=0, le=MAX_STEP, description="The step the client trains from; another step on the server gets a 409 "
                                "(`step_conflict`) and trains nothing. None skips the check.")
    cancel_on_disconnect: bool = Field(
        False, description="Cancel (and roll back) the step when the client disconnects; by default it completes.")


class LogRequest(_Strict):
    """`model.log(...)` after the client has summarised it: the history row and the groups."""

    split: str
    step: int = Field(ge=0, le=MAX_STEP)
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


class Cancelled(BaseModel):
    cancelled: bool = Field(description="True when a running step was told to stop; it rolls back and its "
                                        "train stream ends with a 409 `step_cancelled` error line.")


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


def _line(event: dict[str, Any]) -> bytes:
    # Python's json: a diverged loss arrives as NaN rather than failing the whole stream.
    return (json.dumps(event, default=str) + "\n").encode()


def _json(content: Any) -> Response:
    """Like JSONResponse, but NaN metrics (from history) do not fail the response."""
    return Response(json.dumps(content, default=str), media_type="application/json")


def _option_field(exc: ArtValueError, body: TrainRequest) -> str | None:
    """`options.beta`, `dev_config.epsilon` or `config.learning_rate`: where the first option that
    `TrainOptions.build` complains about came from (the last of the three wins, as in the merge)."""
    text = str(exc.field or exc).removeprefix("invalid training config: ")
    named = re.match(r"unknown option '([^']+)'|([A-Za-z_]\w*)", text)
    name = named and (named.group(1) or named.group(2))
    for where, given in (("options", body.options), ("dev_config", body.dev_config),
                         ("config", body.config.model_dump(exclude_unset=True) if body.config else {})):
        if name in given:
            return f"{where}.{name}"
    return name or exc.field


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


class _ModelRef:
    """A model known only by its names (logs of a model this server never registered)."""

    trainable = False

    def __init__(self, project: str, name: str) -> None:
        self.project, self.name = project, name


def model_key(project: str, name: str) -> tuple[str, str]:
    """Path parameters, checked like every stored name (no separators, no traversal)."""
    return validate_name(project, "project"), validate_name(name, "name")


class Registrations:
    """The models this server process has registered, and their recovery from disk.

    `backend` is a `LocalBackend`: `stored_model(project, name)` gives a run's model.json and
    `stored_models(name)` the (project, name) pairs stored under a model name.
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        self.models: dict[tuple[str, str], Model] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def lock(self, key: tuple[str, str]) -> asyncio.Lock:
        """Held while `key` is loaded: one load per model, however many requests name it."""
        return self._locks.setdefault(key, asyncio.Lock())

    async def recover(self, key: tuple[str, str]) -> Model | None:
        """The registered model, or the stored run registered again from its model.json (a
        restart); None when this server has neither."""
        if key in self.models:
            return self.models[key]
        async with self.lock(key):
            if key in self.models:
                return self.models[key]
            stored = await asyncio.to_thread(self.backend.stored_model, *key)
            if not stored or not isinstance(stored.get("base_model"), str):
                return None
            internal = stored.get("internal_config")
            model = TrainableModel(name=key[1], project=key[0], base_model=stored["base_model"],
                                   config=stored.get("config"),
                                   _internal_config=internal if isinstance(internal, dict) else None)
            log.warning("%s/%s was not registered in this server process: loading it from its stored run "
                        "(a restart?)", *key)
            try:
                await self.backend.register(model)
            except Exception as exc:
                raise BackendError(f"{key[0]}/{key[1]} is stored under the server's path but could not be loaded "
                                   f"again ({type(exc).__name__}: {exc}); register it again") from exc
            self.models[key] = model
            return model

    async def recover_served(self, requested: str) -> bool:
        """For the OpenAI routes: `name` or `name@step` of a stored run not loaded yet; True
        when it was loaded. A name stored under several projects is not guessed."""
        name = requested.partition("@")[0]
        try:
            validate_name(name, "model")
        except ArtValueError:
            return False
        keys = [key for key in await asyncio.to_thread(self.backend.stored_models, name) if key not in self.models]
        if len(keys) > 1:
            raise ModelNotFoundError(
                f"The model {echo(requested)} is not loaded, and runs named {echo(name)} are stored in several projects "
                f"({', '.join(p for p, _ in keys)}): register the one you mean with `await model.register(backend)`")
        return bool(keys) and await self.recover(keys[0]) is not None


# -- the routes ------------------------------------------------------------------------------


def management_router(backend, *, heartbeat_s: float = 10.0, registrations: Registrations | None = None,
                      model_roots: list | None = None) -> APIRouter:
    """Routes under `/art` backed by `backend` (a `LocalBackend` in this process). `model_roots`:
    the server folders a registered `base_model` path may point into (None: any)."""
    router = APIRouter(prefix="/art", tags=["management"])
    registrations = registrations or Registrations(backend)
    models = registrations.models
    running: set[asyncio.Task] = set()  # train tasks outlive their requests; keep them referenced

    async def registered(key: tuple[str, str]) -> Model:
        model = await registrations.recover(key)
        if model is None:
            raise ModelNotFoundError(
                f"model {key[0]}/{key[1]} is not registered on this server and no run of it is stored under "
                "its storage path: call `await model.register(backend)`")
        return model

    async def trainable(key: tuple[str, str]) -> TrainableModel:
        model = await registered(key)
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
        if body.base_model is not None:
            check_base_model(body.base_model, model_roots)
        async with registrations.lock(key):  # one load per model
            common = dict(name=body.name, project=body.project, config=body.config)
            if body.trainable:
                model = TrainableModel(base_model=body.base_model, _internal_config=body.internal_config, **common)
            else:
                model = Model(inference_base_url=body.inference_base_url,
                              inference_model_name=body.inference_model_name, **common)
            try:
                await backend.register(model)
            except ArtValueError:
                raise
            except OSError as exc:  # mostly transformers' "no such model": name what was asked for
                raise ArtValueError(f"registering {body.project}/{body.name} failed on the server; check "
                                    f"base_model {echo(body.base_model)}: {echo(str(exc))}", field="base_model") from exc
            except (TypeError, ValueError) as exc:  # what peft, the engine or torch refused in it
                raise ArtValueError(f"registering {body.project}/{body.name} failed on the server; check "
                                    f"internal_config {echo(body.internal_config)}: {echo(str(exc))}",
                                    field="internal_config") from exc
            models[key] = model
            return await info(model)

    @router.get("/models", response_model=list[ModelInfo], summary="List registered models")
    @_answer_errors
    async def list_models() -> list[ModelInfo]:
        return [await info(model) for model in list(models.values())]

    @router.get("/models/{project}/{name}/step", response_model=StepInfo, summary="Latest step")
    @_answer_errors
    async def get_step(key: tuple[str, str] = Depends(model_key)) -> StepInfo:
        model = await registrations.recover(key) or _ModelRef(*key)
        return StepInfo(step=await backend._get_step(model))

    @router.post(
        "/models/{project}/{name}/train",
        summary="Train one step (streams NDJSON progress)",
        response_class=StreamingResponse,
        responses={200: {"description": "One JSON object per line; see `TrainEvent`.",
                         "content": {"application/x-ndjson": {"schema": TrainEvent.model_json_schema()}}}},
    )
    @_answer_errors
    async def train(body: TrainRequest, request: Request,
                    key: tuple[str, str] = Depends(model_key)) -> StreamingResponse:
        from art.training.options import TrainOptions  # server side only: it brings torch

        model = await trainable(key)
        groups = await asyncio.to_thread(_groups, body.trajectory_groups)  # CPU work off the event loop
        config = body.config.model_dump() if body.config else {}
        try:  # a 400 before streaming, naming where the bad option was sent
            TrainOptions.build(None, {**config, **body.dev_config, **body.options})
        except ArtValueError as exc:
            raise ArtValueError(str(exc), field=_option_field(exc, body)) from None
        await backend.check_training_input(model, groups)  # malformed trajectories: a 400, not a stream error
        current = await backend._get_step(model)
        if body.expected_step is not None and body.expected_step != current:
            raise StepConflictError.between(f"{key[0]}/{key[1]}", body.expected_step, current)
        step = current + 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def progress(event: dict[str, Any]) -> None:  # called from the training thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        caller = tracing.extract_context(request.headers)  # the client's trace continues in the step

        async def train_step():
            with tracing.span("art.train_request", {"art.model": f"{key[0]}/{key[1]}"}, kind="SERVER",
                              context=caller):
                return await backend.train(model, groups, config=body.config, _config=body.dev_config,
                                           progress=progress, expected_step=body.expected_step, **body.options)

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
                    await backend.cancel_training(model)

        async def events():
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
    async def cancel(key: tuple[str, str] = Depends(model_key)) -> Cancelled:
        return Cancelled(cancelled=await backend.cancel_training(await trainable(key)))

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
        model = await trainable(key)
        return Checkpoints(steps=await backend._list_checkpoints(model), latest=await backend._get_step(model))

    @router.delete("/models/{project}/{name}/checkpoints", response_model=DeletedCheckpoints,
                   summary="Keep the latest and the best step; delete the rest")
    @_answer_errors
    async def delete_checkpoints(
        key: tuple[str, str] = Depends(model_key),
        best_checkpoint_metric: str = Query("val/reward", min_length=1, max_length=MAX_METRIC_NAME,
                                           description="History metric whose best step is kept."),
    ) -> DeletedCheckpoints:
        model = await trainable(key)
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
