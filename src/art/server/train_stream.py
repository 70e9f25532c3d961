"""A training step on the wire: started as its own task that outlives its request, streamed as
NDJSON `TrainEvent` lines (progress, heartbeats while it is silent, its result or its error), and
abandoned cleanly when the server shuts down (`RunningSteps`). The management routes
(`art.server.management`) check the request and call `train_stream`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from art.errors import BackendUnavailableError, StepCancelledError, StepConflictError
from art.observability import tracing
from art.server.errors import error_object
from art.server.management_schemas import TrainRequest, TrainSFTRequest
from art.service import ModelKey, Progress, Service, TrainEvent, TrainResult

log = logging.getLogger(__name__)


def _line(event: dict[str, Any]) -> bytes:
    # Python's json: a diverged loss arrives as NaN rather than failing the whole stream.
    return (json.dumps(event, default=str) + "\n").encode()


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
    queue: asyncio.Queue[TrainEvent | None] = asyncio.Queue()
    caller = tracing.extract_context(request.headers)  # the client's trace continues in the step
    task = _start_step(key, run, queue, caller=caller, running=running)
    stream = _StepStream(service, key, task, queue, running, heartbeat_s, started=time.monotonic())
    first = {"type": "accepted", "step": current + 1, **accepted}
    return StreamingResponse(stream.lines(first, body.cancel_on_disconnect), media_type="application/x-ndjson")


def _start_step(
    key: ModelKey,
    run: Callable[[Progress], Awaitable[TrainResult]],
    queue: asyncio.Queue,
    *,
    caller: Any,
    running: RunningSteps,
) -> asyncio.Task:
    """Run the step as its own task, so it outlives its request, its progress put in `queue`."""
    loop = asyncio.get_running_loop()

    def progress(event: TrainEvent) -> None:  # called from the training thread
        loop.call_soon_threadsafe(queue.put_nowait, event)

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
    return task


@dataclass
class _StepStream:
    """A running step's NDJSON lines, apart from starting it: its queue's events, heartbeats
    while it is silent, and its result or why it has none."""

    service: Service
    key: ModelKey
    task: asyncio.Task
    queue: asyncio.Queue
    running: RunningSteps
    heartbeat_s: float
    started: float

    async def lines(self, first: dict[str, Any], cancel_on_disconnect: bool):
        """The lines, cancelling the step when its client leaves (if the request asked for that)."""
        try:
            async for line in self.events(first):
                yield line
        finally:  # the generator ends early when the client disconnects
            if cancel_on_disconnect and not self.task.done():
                log.warning("client of %s/%s left: cancelling its training step", *self.key)
                await self.service.cancel_training(self.key)

    async def events(self, first: dict[str, Any]):
        """`first`, then the step's events as they come, then its outcome."""
        yield _line(first)
        while True:
            try:
                event = await asyncio.wait_for(self.queue.get(), self.heartbeat_s)
            except asyncio.TimeoutError:
                yield _line({"type": "heartbeat", "elapsed_s": round(time.monotonic() - self.started, 1)})
                continue
            if event is _SHUTDOWN:
                await asyncio.wait([self.task], timeout=self.running.stream_wait_s)  # ends at its next micro-batch
                if not self.task.done():
                    abandoned = _abandoned(self.key, await self.service.step(self.key), stopped=False)
                    yield _line({"type": "error", "error": error_object(abandoned)})
                    return
                break
            if event is None:
                break
            yield _line(event)
        yield _line(await self.outcome())

    async def outcome(self) -> dict[str, Any]:
        """The last line of a step that ended: its result, or the error that ended it."""
        task = self.task
        if self.running.shutting_down and _stopped(task):
            abandoned = _abandoned(self.key, await self.service.step(self.key), stopped=True)
            return {"type": "error", "error": error_object(abandoned)}
        if task.cancelled():
            cancelled = BackendUnavailableError("the step was cancelled (server shutdown)")
            return {"type": "error", "error": error_object(cancelled)}
        failure = task.exception()
        if failure is not None:
            return {"type": "error", "error": error_object(failure)}
        result = task.result()
        return {"type": "result", "step": result.step, "metrics": result.metrics}


def _report(task: asyncio.Task, key: tuple[str, str]) -> None:
    """Log how a train task ended (its client may be gone; this also retrieves the exception)."""
    if task.cancelled():
        log.warning("training of %s/%s was cancelled", *key)
    elif task.exception() is not None:
        log.warning("training of %s/%s failed: %s", *key, task.exception())
    else:
        log.info("%s/%s trained to step %d", *key, task.result().step)
