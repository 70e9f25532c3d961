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
    │   └── WeightSyncError                served logprobs differ from the trainer's after an update
    ├── TooManyExceptionsError (RuntimeError)  gather saw more rollout exceptions than allowed
    ├── JudgeError (RuntimeError)          a RULER judge gave no usable answer within its retries
    └── CaptureError (RuntimeError)        auto_trajectory(required=True) outside a capture

The HTTP server maps these once: ArtValueError -> 400, ModelNotFoundError -> 404,
StepConflictError and StepCancelledError -> 409, BackendUnavailableError -> 503, any other ArtError -> 500.
"""

from __future__ import annotations


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
            message = (f"{model} is already at step {current}, but this update was sent to train from step "
                       f"{expected}: an earlier train call (most likely this same one, whose connection broke) "
                       "has completed on the server. It is not applied twice; continue from "
                       "`await model.get_step()` with new trajectories.")
        else:
            message = (f"{model} is at step {current} on the server, but this update was sent to train from "
                       f"step {expected} (a rolled-back step, deleted checkpoints, or another --path?); "
                       "check `await model.get_step()`.")
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


class TooManyExceptionsError(ArtError, RuntimeError):
    """More rollouts raised than `max_exceptions` allows."""


class JudgeError(ArtError, RuntimeError):
    """A RULER judge gave no usable answer (malformed, ids missing or repeated, or the call
    failed) in all of its tries."""


class CaptureError(ArtError, RuntimeError):
    """`art.auto_trajectory(required=True)` was called where no trajectory is being captured."""
