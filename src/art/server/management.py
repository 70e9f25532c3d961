"""Management routes: what `art.RemoteBackend` calls to register, train and log models.

They sit beside the OpenAI routes (`art.server.app`) in the app that `art serve` runs, and
hold no model state: every call goes to the service living in the server process (an
`art.service.Service`, which `LocalBackend` also adapts in process, and `art.RemoteService`
speaks from the other side). This module only turns JSON into those calls and back; the
routes' bodies and the train stream's lines are specified in `art.server.management_schemas`, and a
step's stream is `art.server.train_stream`'s.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from art.errors import ArtError, ArtValueError
from art.naming import MAX_METRIC_NAME, echo
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
    TrajectoryPayload,
)
from art.server.security import check_base_model
from art.server.train_stream import RunningSteps, train_stream
from art.service import ModelKey, ModelSpec, Service, TrainEvent, resolve_train_options
from art.storage.history import rows_for_split
from art.storage.layout import validate_name
from art.training.sft_options import resolve_sft_options
from art.trajectories import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


# -- conversion helpers ------------------------------------------------------------------


def _groups(payloads: list[TrajectoryGroupPayload]) -> list[TrajectoryGroup]:
    return [g.to_group(f"trajectory_groups[{i}]") for i, g in enumerate(payloads)]


def _trajectories(payloads: list[TrajectoryPayload]) -> list[Trajectory]:
    """An SFT request's trajectories, each error naming its index (CPU work: off the event loop)."""
    return [t.to_trajectory(f"trajectories[{i}]") for i, t in enumerate(payloads)]


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

_Uploads = dict[ModelKey, tuple[str, list[TrajectoryGroup]]]
"""Each model's last train groups, under the client's `upload_id`, so its log need not send them again."""


def management_router(
    service: Service, *, heartbeat_s: float = 10.0, model_roots: list | None = None, running: RunningSteps | None = None
) -> APIRouter:
    """Routes under `/art` over `service`. `model_roots`: the server folders a registered
    `base_model` path may point into (None: any). `running`: where the training steps are kept
    (the server abandons them when it shuts down)."""
    router = APIRouter(prefix="/art", tags=["management"])
    running = running if running is not None else RunningSteps()
    uploads: _Uploads = {}
    # Registered in this order, which is also the order of the OpenAPI document's paths.
    _add_model_routes(router, service, model_roots)
    _add_training_routes(router, service, uploads, heartbeat_s=heartbeat_s, running=running)
    _add_log_route(router, service, uploads)
    _add_checkpoint_routes(router, service, model_roots)
    _add_metrics_route(router, service)
    return router


async def _model_info(service: Service, spec: ModelSpec) -> ModelInfo:
    """A registered model as the routes answer it: its spec and latest step."""
    return ModelInfo(
        project=spec.project,
        name=spec.name,
        trainable=spec.trainable,
        base_model=spec.base_model,
        step=await service.step(spec.key),
    )


def _add_model_routes(router: APIRouter, service: Service, model_roots: list | None) -> None:
    """Register, list, and read a model's step: what a client does before it trains."""

    @router.post("/models", response_model=ModelInfo, summary="Register a model")
    @_answer_errors
    async def register(body: RegisterRequest) -> ModelInfo:
        if body.base_model is not None:
            check_base_model(body.base_model, model_roots)
        spec = ModelSpec(**body.model_dump())
        await service.register(spec)
        return await _model_info(service, spec)

    @router.get("/models", response_model=list[ModelInfo], summary="List registered models")
    @_answer_errors
    async def list_models() -> list[ModelInfo]:
        return [await _model_info(service, spec) for spec in await service.specs()]

    @router.get("/models/{project}/{name}/step", response_model=StepInfo, summary="Latest step")
    @_answer_errors
    async def get_step(key: ModelKey = Depends(model_key)) -> StepInfo:
        return StepInfo(step=await service.step(key))


def _train_responses(description: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI answer of a training route: NDJSON lines, each a `TrainEvent`."""
    return {200: {"description": description, "content": {"application/x-ndjson": {"schema": TRAIN_EVENT_SCHEMA}}}}


def _add_training_routes(
    router: APIRouter, service: Service, uploads: _Uploads, *, heartbeat_s: float, running: RunningSteps
) -> None:
    """Train a step (RL or SFT), streamed, and cancel the running one."""

    @router.post(
        "/models/{project}/{name}/train",
        summary="Train one step (streams NDJSON progress)",
        response_class=StreamingResponse,
        responses=_train_responses("One JSON object per line; see `TrainEvent`."),
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
        responses=_train_responses("One JSON object per line; see `TrainEvent` (one `gradient_step` per batch)."),
    )
    @_answer_errors
    async def train_sft(
        body: TrainSFTRequest, request: Request, key: ModelKey = Depends(model_key)
    ) -> StreamingResponse:
        options = resolve_sft_options(body.config, body.dev_config, body.options)  # a 400 naming where
        trajectories = await asyncio.to_thread(_trajectories, body.trajectories)

        def run(progress):
            return service.train_sft(key, trajectories, options, expected_step=body.expected_step, progress=progress)

        accepted = {"trajectories": len(trajectories)}
        return await train_stream(
            service, key, run, body=body, request=request, accepted=accepted, heartbeat_s=heartbeat_s, running=running
        )

    @router.delete(
        "/models/{project}/{name}/train",
        response_model=Cancelled,
        summary="Cancel the running training step (it rolls back)",
    )
    @_answer_errors
    async def cancel(key: ModelKey = Depends(model_key)) -> Cancelled:
        return Cancelled(cancelled=await service.cancel_training(key))


def _add_log_route(router: APIRouter, service: Service, uploads: _Uploads) -> None:
    """Log a step's metrics and trajectories, sent or held from the model's last train call."""

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


def _add_checkpoint_routes(router: APIRouter, service: Service, model_roots: list | None) -> None:
    """List, prune and fork a model's checkpoints, and restart the replicas that serve them."""

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


def _add_metrics_route(router: APIRouter, service: Service) -> None:
    """Read a model's history rows (what `log` wrote), for the client and the dashboard."""

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
