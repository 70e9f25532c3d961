"""Which ART model the running rollout trains: set by `wrap_rollout`, read by `init_chat_model`.

A context variable, so concurrent rollouts (each its own task) see their own model and tasks a
rollout starts inherit it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from art.model import Model

_MODEL: contextvars.ContextVar[Model | None] = contextvars.ContextVar("art_langgraph_model", default=None)


def rollout_model() -> Model | None:
    """The model of the `wrap_rollout` running here, or None outside one."""
    return _MODEL.get()


@contextlib.contextmanager
def training(model: Model) -> Iterator[None]:
    """Make `model` the rollout's model inside the block."""
    token = _MODEL.set(model)
    try:
        yield
    finally:
        _MODEL.reset(token)


def served_names(model: Model) -> set[str]:
    """The names requests to `model` carry, before any `@step` suffix."""
    return {model.name, model.get_inference_name()}
