"""One error tree for the whole library; each error also refines the stdlib type it is.

    ArtError
    ├── ArtValueError (ValueError)         bad input from the user; names the field
    │   ├── ContextLengthError             prompt + max_tokens exceed the model length
    │   └── TrajectoryError                a trajectory that cannot be trained as given
    ├── ModelNotFoundError (LookupError)   unknown model name or step
    ├── BackendError (RuntimeError)        the backend failed to do what it was asked
    └── TooManyExceptionsError (RuntimeError)  gather saw more rollout exceptions than allowed

The HTTP server maps these once: ArtValueError -> 400, ModelNotFoundError -> 404.
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


class TooManyExceptionsError(ArtError, RuntimeError):
    """More rollouts raised than `max_exceptions` allows."""
