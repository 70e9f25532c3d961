"""One error tree for the whole library; each error also refines the stdlib type it is.

    ArtError
    ├── ArtValueError (ValueError)         bad input from the user; names the field
    │   ├── ContextLengthError             prompt + max_tokens exceed the model length
    │   └── TrajectoryError                a trajectory that cannot be trained as given
    ├── ModelNotFoundError (LookupError)   unknown model name or step
    ├── BackendError (RuntimeError)        the backend failed to do what it was asked
    │   ├── StepConflictError              a train call expected another step (a retry of a done step)
    │   ├── StepCancelledError             a train call was cancelled; the step was rolled back
    │   ├── BackendUnavailableError        stopped or shutting down: try again later
    │   ├── WeightSyncError                served logprobs differ from the trainer's after an update
    │   └── ArtVllmMetricsTimeoutError (TimeoutError)  the engine's metrics did not come in time
    ├── TooManyExceptionsError (RuntimeError)  gather saw more rollout exceptions than allowed
    ├── JudgeError (RuntimeError)          a RULER judge gave no usable answer within its retries
    └── CaptureError (RuntimeError)        auto_trajectory(required=True) outside a capture

Errors cross a boundary (HTTP, a process pipe) through one table, `WIRE`: the HTTP status and
OpenAI error code of each class (ArtValueError -> 400, ModelNotFoundError -> 404,
StepConflictError and StepCancelledError -> 409, BackendUnavailableError -> 503, any other
ArtError -> 500). `to_wire` writes an error's body, `from_wire` reads one back, so the server's
mapping and its clients' inverse cannot drift.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ArtError(Exception):
    """Base of every error this library raises on purpose."""


class ArtValueError(ArtError, ValueError):
    """Bad input. `field` names the offending field when there is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContextLengthError(ArtValueError):
    """The prompt (plus the requested completion) does not fit the model's context."""


class TrajectoryError(ArtValueError):
    """A trajectory or group that cannot be trained as given."""


class ModelNotFoundError(ArtError, LookupError):
    """No served model (or checkpoint step) has this name."""


class BackendError(ArtError, RuntimeError):
    """The backend failed to carry out a request."""


class StepConflictError(BackendError):
    """A train call was sent for `expected_step` but the model is at `current_step`.

    Usually a retry of a call whose connection broke after the server had accepted it: that
    step completed, and training the same groups again would apply them twice.
    """

    def __init__(self, message: str, expected_step: int | None = None, current_step: int | None = None) -> None:
        super().__init__(message)
        self.expected_step = expected_step
        self.current_step = current_step

    @classmethod
    def between(cls, model: str, expected: int, current: int) -> StepConflictError:
        if current > expected:
            message = (
                f"{model} is already at step {current}, but this update was sent to train from step "
                f"{expected}: an earlier train call (most likely this same one, whose connection broke) "
                "has completed on the server. It is not applied twice; continue from "
                "`await model.get_step()` with new trajectories."
            )
        else:
            message = (
                f"{model} is at step {current} on the server, but this update was sent to train from "
                f"step {expected} (a rolled-back step, deleted checkpoints, or another --path?); "
                "check `await model.get_step()`."
            )
        return cls(message, expected_step=expected, current_step=current)


class StepCancelledError(BackendError):
    """A training step was cancelled (`DELETE` on the model's train route, or its client left
    with `cancel_on_disconnect`) before it finished; its weights were rolled back."""


class BackendUnavailableError(BackendError):
    """The backend cannot take the request now (stopped, shutting down); retrying later may work."""

    retry_after: int = 1
    """Seconds to wait before sending the request again (the 503's Retry-After header)."""


class WeightSyncError(BackendError):
    """After a weight update the engine served logprobs that differ from the trainer's."""


class ArtVllmMetricsTimeoutError(BackendError, TimeoutError):
    """The serving engine's metrics (`/art/metrics`, ART's name for vLLM's) did not answer in time.
    Worth retrying: the engine is busy, not broken."""


class TooManyExceptionsError(ArtError, RuntimeError):
    """More rollouts raised than `max_exceptions` allows."""


class JudgeError(ArtError, RuntimeError):
    """A RULER judge gave no usable answer (malformed, ids missing or repeated, or the call
    failed) in all of its tries."""


class CaptureError(ArtError, RuntimeError):
    """`art.auto_trajectory(required=True)` was called where no trajectory is being captured."""


class Wire(NamedTuple):
    """How an error class travels: OpenAI's error object and the HTTP status it is answered with."""

    status: int
    type: str
    code: str | None
    param: str | None = None
    """The request field to blame (an ArtValueError names its own `field` instead)."""


WIRE: dict[type[ArtError], Wire] = {
    ArtValueError: Wire(400, "invalid_request_error", None),
    ContextLengthError: Wire(400, "invalid_request_error", "context_length_exceeded"),
    ModelNotFoundError: Wire(404, "invalid_request_error", "model_not_found", "model"),
    StepConflictError: Wire(409, "invalid_request_error", "step_conflict", "expected_step"),
    StepCancelledError: Wire(409, "invalid_request_error", "step_cancelled"),
    BackendUnavailableError: Wire(503, "server_error", "unavailable"),  # stopped, restarting: worth sending again
    BackendError: Wire(500, "server_error", None),  # also any other ArtError: the library's message for the user
}
"""Each class's wire form; a body maps back to the most specific class whose row it matches."""


def to_wire(exc: ArtError) -> dict[str, Any]:
    """OpenAI's error object for `exc` (`message`, `type`, `param`, `code`, and the fields its
    class carries) with the HTTP `status` it is answered with."""
    row = WIRE[_most_specific(cls for cls in WIRE if isinstance(exc, cls)) or BackendError]
    param = row.param
    if isinstance(exc, ArtValueError):
        param = exc.field if isinstance(exc.field, str) else None
    body: dict[str, Any] = {"message": str(exc), "type": row.type, "param": param, "code": row.code}
    if isinstance(exc, StepConflictError):
        body.update(expected_step=exc.expected_step, current_step=exc.current_step)
    if isinstance(exc, BackendUnavailableError):
        body["retry_after"] = exc.retry_after
    return {**body, "status": row.status}


def from_wire(status: int, body: dict[str, Any]) -> ArtError:
    """The exception an error object (`to_wire`'s, or any OpenAI-shaped one) stands for.

    The most specific class whose row has this `status` and this `code` (a row without a code
    takes any) wins, as httpx's `map_httpcore_exceptions` picks its mapping. A status no row
    claims falls back by its kind: 503 -> BackendUnavailableError, another 4xx but 404 ->
    ArtValueError, anything else -> BackendError.
    """
    message = str(body.get("message") or f"HTTP {status}")
    code = body.get("code")
    cls = _most_specific(cls for cls, row in WIRE.items() if row.status == status and row.code in (None, code))
    if cls is None:
        cls = (
            BackendUnavailableError
            if status == 503
            else ArtValueError
            if 400 <= status < 500 and status != 404
            else BackendError
        )
    if issubclass(cls, ArtValueError):
        return cls(message, field=body.get("param"))
    if issubclass(cls, StepConflictError):
        return cls(message, expected_step=body.get("expected_step"), current_step=body.get("current_step"))
    exc = cls(message)
    if isinstance(exc, BackendUnavailableError) and isinstance(body.get("retry_after"), int):
        exc.retry_after = body["retry_after"]
    return exc


def _most_specific(classes) -> type[ArtError] | None:
    """The class that is a subclass of every other one given (None when none is given)."""
    chosen = None
    for cls in classes:
        if chosen is None or issubclass(cls, chosen):
            chosen = cls
    return chosen
