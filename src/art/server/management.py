"""Management routes: what `art.RemoteBackend` calls to register, train and log models.

They sit beside the OpenAI routes (`art.server.app`) in the app that `art serve` runs, and
hold no model state: every call goes to the service living in the server process (an
`art.service.Service`, which `LocalBackend` also adapts in process, and `art.RemoteService`
speaks from the other side). This module only turns JSON into those calls and back; the
routes' bodies and the train stream's lines are specified in `art.server.management_schemas`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from art.errors import ArtError, ArtValueError, BackendUnavailableError, StepCancelledError, StepConflictError
from art.naming import MAX_METRIC_NAME, echo
from art.observability import tracing
from art.server.errors import error_object, error_response
from art.server.management_schemas import (
    Cancelled,
    Checkpoints,
    DeletedCheckpoints,
    Forked,
    ForkRequest,
    Logged,
    LogRequest,
    ModelInfo,
    RegisterRequest,
    RestartedReplicas,
    StepInfo,
    TrainRequest,
    TrainSFTRequest,
    TrajectoryGroupPayload,
)
from art.server.security import check_base_model
from art.service import ModelKey, ModelSpec, Progress, Service, TrainEvent, TrainResult, resolve_train_options
from art.storage.history import rows_for_split
from art.storage.layout import validate_name
from art.training.sft_options import resolve_sft_options
from art.trajectories import TrajectoryGroup

log = logging.getLogger(__name__)


# -- conversion helpers ------------------------------------------------------------------


def _groups(payloads: list[TrajectoryGroupPayload]) -> list[TrajectoryGroup]:
    return [g.to_group(f"trajectory_groups[{i}]") for i, g in enumerate(payloads)]


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


_SHUTDOWN = object()
"""Put in a running step's event queue when the server starts shutting down."""


class RunningSteps:
    """The training steps a server runs, each as its own task that outlives its request (kept
    referenced here until it ends).

    When the server shuts down (`abandon`, called by `art.serve` before it waits for open
    connections) every running step is cancelled: it stops at its next micro-batch and rolls
    back. Its stream ends within `stream_wait_s` with an error saying so, and new steps are
    refused. `settle`, from the app's shutdown, waits for the steps to end and logs, one line
    per model, what became of each step."""

    def __init__(self, *, stream_wait_s: float = 5.0, settle_wait_s: float = 120.0) -> None:
        self.stream_wait_s = stream_wait_s
        """How long a stream waits for its cancelled step; below uvicorn's graceful timeout (10 s)."""
        self.settle_wait_s = settle_wait_s
        """How long shutdown waits for a cancelled step to reach its next micro-batch."""
        self.shutting_down = False
        self._tasks: dict[asyncio.Task, tuple[ModelKey, asyncio.Queue]] = {}
        self._abandoned: dict[asyncio.Task, tuple[ModelKey, asyncio.Queue]] = {}

    def add(self, task: asyncio.Task, key: ModelKey, queue: asyncio.Queue) -> None:
        self._tasks[task] = (key, queue)
        task.add_done_callback(self._tasks.pop)  # the task itself is the key: removed once it ends

    async def abandon(self, service: Service) -> None:
        """Cancel every running step and wake its stream; refuse new ones from now on."""
        self.shutting_down = True
        self._abandoned = dict(self._tasks)
        for key in {key for key, _ in self._abandoned.values()}:
            try:
                await service.cancel_training(key)
            except Exception as exc:  # the shutdown goes on; `settle` says what became of the step
                log.warning("shutting down: could not stop the training step of %s/%s: %s", *key, exc)
        for _, queue in self._abandoned.values():
            queue.put_nowait(_SHUTDOWN)

    async def settle(self, service: Service) -> None:
        """Wait for the abandoned steps to end; log in one line per model what became of them."""
        if not self._abandoned:
            return
        await asyncio.wait(list(self._abandoned), timeout=self.settle_wait_s)
        reported: set[ModelKey] = set()
        for task, (key, _) in self._abandoned.items():
            if key in reported or (task.done() and not _stopped(task)):
                continue  # a step that finished (or failed) before it could stop was logged as usual
            reported.add(key)
            stays = await service.step(key)
            if task.done():
                log.warning("shutting down: training step of %s/%s abandoned; the model stays at step %d", *key, stays)
            else:
                log.warning(
                    "shutting down: training step of %s/%s did not stop within %g s; abandoned, the model "
                    "stays at step %d unless the step's checkpoint lands before the process ends",
                    *key,
                    self.settle_wait_s,
                    stays,
                )

    def refuse_if_shutting_down(self) -> None:
        if self.shutting_down:
            raise BackendUnavailableError("the server is shutting down: send the step again once it is back")


def _stopped(task: asyncio.Task) -> bool:
    """Whether an ended train task was stopped (cancelled), rather than trained or failed."""
    return task.cancelled() or isinstance(task.exception(), StepCancelledError)


def _abandoned(key: ModelKey, step: int, *, stopped: bool) -> BackendUnavailableError:
    """What the client of a step abandoned at shutdown is told."""
    how = "was abandoned and rolled back" if stopped else "is being abandoned (it rolls back at its next micro-batch)"
    return BackendUnavailableError(
        f"the server is shutting down: the training step of {key[0]}/{key[1]} {how}; "
        f"the model stays at step {step}. Send the step again once the server is back"
    )


async def train_stream(
    service: Service,
    key: ModelKey,
    run: Callable[[Progress], Awaitable[TrainResult]],
    *,
    body: TrainRequest | TrainSFTRequest,
    request: Request,
    accepted: dict[str, Any],
    heartbeat_s: float,
    running: RunningSteps,
) -> StreamingResponse:
    """Start `run(progress)` (a service update of `key`) as its own task and stream its TrainEvents
    as NDJSON lines: `accepted` (with `accepted`'s counts), progress, heartbeats every
    `heartbeat_s` of silence, and the result or the error."""
    current = await service.step(key)
    if body.expected_step is not None and body.expected_step != current:
        raise StepConflictError.between(f"{key[0]}/{key[1]}", body.expected_step, current)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[TrainEvent | None] = asyncio.Queue()

    def progress(event: TrainEvent) -> None:  # called from the training thread
        loop.call_soon_threadsafe(queue.put_nowait, event)

    caller = tracing.extract_context(request.headers)  # the client's trace continues in the step

    async def train_step():
        with tracing.span("art.train_request", {"art.model": f"{key[0]}/{key[1]}"}, kind="SERVER", context=caller):
            return await run(progress)

    running.refuse_if_shutting_down()  # no await from here to `add`: a step is either refused or abandoned
    task = asyncio.ensure_future(train_step())
    running.add(task, key, queue)

    def finished(task: asyncio.Task) -> None:
        queue.put_nowait(None)
        if not (running.shutting_down and _stopped(task)):  # an abandoned step: `RunningSteps.settle` says so
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
            if event is _SHUTDOWN:
                await asyncio.wait([task], timeout=running.stream_wait_s)  # ends at its next micro-batch
                if not task.done():
                    yield _line(
                        {
                            "type": "error",
                            "error": error_object(_abandoned(key, await service.step(key), stopped=False)),
                        }
                    )
                    return
                break
            if event is None:
                break
            yield _line(event)
        if running.shutting_down and _stopped(task):
            yield _line(
                {"type": "error", "error": error_object(_abandoned(key, await service.step(key), stopped=True))}
            )
        elif task.cancelled():
            cancelled = BackendUnavailableError("the step was cancelled (server shutdown)")
            yield _line({"type": "error", "error": error_object(cancelled)})
        elif task.exception() is not None:
            yield _line({"type": "error", "error": error_object(task.exception())})
        else:
            result = task.result()
            yield _line({"type": "result", "step": result.step, "metrics": result.metrics})

    return StreamingResponse(lines(), media_type="application/x-ndjson")


# -- the routes ------------------------------------------------------------------------------


def management_router(
    service: Service, *, heartbeat_s: float = 10.0, model_roots: list | None = None, running: RunningSteps | None = None
) -> APIRouter:
    """Routes under `/art` over `service`. `model_roots`: the server folders a registered
    `base_model` path may point into (None: any). `running`: where the training steps are kept
    (the server abandons them when it shuts down)."""
    router = APIRouter(prefix="/art", tags=["management"])
    running = running if running is not None else RunningSteps()
    uploads: dict[ModelKey, tuple[str, list[TrajectoryGroup]]] = {}  # each model's last train groups, for its log

    async def info(spec: ModelSpec) -> ModelInfo:
        return ModelInfo(
            project=spec.project,
            name=spec.name,
            trainable=spec.trainable,
            base_model=spec.base_model,
            step=await service.step(spec.key),
        )

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
        responses={
            200: {
                "description": "One JSON object per line; see `TrainEvent`.",
                "content": {"application/x-ndjson": {"schema": TRAIN_EVENT_SCHEMA}},
            }
        },
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

        return await train_stream(
            service, key, run, body=body, request=request, accepted=accepted, heartbeat_s=heartbeat_s, running=running
        )

    @router.post(
        "/models/{project}/{name}/train_sft",
        summary="Supervised fine-tuning, one checkpoint (streams NDJSON progress)",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "One JSON object per line; see `TrainEvent` (one `gradient_step` per batch).",
                "content": {"application/x-ndjson": {"schema": TRAIN_EVENT_SCHEMA}},
            }
        },
    )
    @_answer_errors
    async def train_sft(
        body: TrainSFTRequest, request: Request, key: ModelKey = Depends(model_key)
    ) -> StreamingResponse:
        options = resolve_sft_options(body.config, body.dev_config, body.options)  # a 400 naming where
        trajectories = await asyncio.to_thread(
            lambda: [t.to_trajectory(f"trajectories[{i}]") for i, t in enumerate(body.trajectories)]
        )

        def run(progress):
            return service.train_sft(key, trajectories, options, expected_step=body.expected_step, progress=progress)

        return await train_stream(
            service,
            key,
            run,
            body=body,
            request=request,
            accepted={"trajectories": len(trajectories)},
            heartbeat_s=heartbeat_s,
            running=running,
        )

    @router.delete(
        "/models/{project}/{name}/train",
        response_model=Cancelled,
        summary="Cancel the running training step (it rolls back)",
    )
    @_answer_errors
    async def cancel(key: ModelKey = Depends(model_key)) -> Cancelled:
        return Cancelled(cancelled=await service.cancel_training(key))

    @router.post("/models/{project}/{name}/log", response_model=Logged, summary="Log metrics and trajectories")
    @_answer_errors
    async def log_route(body: LogRequest, key: ModelKey = Depends(model_key)) -> Logged:
        if body.trajectory_groups_from is None:
            groups = await asyncio.to_thread(_groups, body.trajectory_groups)
        elif body.trajectory_groups:
            raise ArtValueError(
                "send trajectory_groups or trajectory_groups_from, not both", field="trajectory_groups_from"
            )
        else:
            upload_id, groups = uploads.get(key, (None, []))
            if upload_id != body.trajectory_groups_from:
                raise ArtValueError(
                    f"no train upload {echo(body.trajectory_groups_from)} of {key[0]}/{key[1]} is held "
                    "here (another train call replaced it, or the server restarted): send "
                    "trajectory_groups",
                    field="trajectory_groups_from",
                )
            del uploads[key]
        row = await service.log(
            key, split=body.split, step=body.step, metrics=body.metrics, groups=groups, scenario_ids=body.scenario_ids
        )
        return Logged(split=body.split, step=body.step, trajectories=sum(len(g.trajectories) for g in groups), row=row)

    @router.get("/models/{project}/{name}/checkpoints", response_model=Checkpoints, summary="Saved steps")
    @_answer_errors
    async def list_checkpoints(key: ModelKey = Depends(model_key)) -> Checkpoints:
        return Checkpoints(steps=await service.checkpoints(key), latest=await service.step(key))

    @router.delete(
        "/models/{project}/{name}/checkpoints",
        response_model=DeletedCheckpoints,
        summary="Keep the latest and the best step (or the steps named); delete the rest",
    )
    @_answer_errors
    async def delete_checkpoints(
        key: ModelKey = Depends(model_key),
        best_checkpoint_metric: str = Query(
            "val/reward",
            min_length=1,
            max_length=MAX_METRIC_NAME,
            description="History metric whose best step is kept.",
        ),
        keep_step: list[int] | None = Query(
            None,
            description="Steps to keep instead of the best one (repeat the parameter); the latest step is always kept.",
        ),
    ) -> DeletedCheckpoints:
        deleted = await service.delete_checkpoints(key, best_checkpoint_metric, keep_steps=keep_step)
        return DeletedCheckpoints(deleted=deleted, kept=await service.checkpoints(key))

    @router.post(
        "/models/{project}/{name}/replicas/restart",
        response_model=RestartedReplicas,
        summary="Start the engine replicas that left the rotation again",
    )
    @_answer_errors
    async def restart_replicas(key: ModelKey = Depends(model_key)) -> RestartedReplicas:
        return RestartedReplicas(restarted=await service.restart_replicas(key))

    @router.post(
        "/models/{project}/{name}/fork",
        response_model=Forked,
        summary="Start the model from another model's checkpoint",
    )
    @_answer_errors
    async def fork(body: ForkRequest, key: ModelKey = Depends(model_key)) -> Forked:
        check_base_model(body.base_model, model_roots)
        spec = ModelSpec(
            project=key[0],
            name=key[1],
            trainable=True,
            base_model=body.base_model,
            config=body.config,
            internal_config=body.internal_config,
        )
        step = await service.fork_checkpoint(
            spec, (body.from_project, body.from_model), not_after_step=body.not_after_step
        )
        return Forked(step=step)

    @router.get(
        "/models/{project}/{name}/metrics",
        summary="History rows (history.jsonl)",
        responses={200: {"description": '`{"rows": [...]}`, oldest first'}},
    )
    @_answer_errors
    async def metrics(
        key: ModelKey = Depends(model_key),
        split: str | None = Query(None, description="Only rows logged for this split."),
    ) -> Response:
        rows = await service.history(key)
        if split is not None:
            rows = rows_for_split(rows, split)
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
