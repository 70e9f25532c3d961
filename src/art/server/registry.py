"""What the HTTP app needs from whoever holds the models: name resolution, nothing else.

The app holds no model state; a backend hands it an object with this shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from art.engine.base import AdapterRef, Engine
from art.errors import ModelNotFoundError
from art.naming import echo


@dataclass(frozen=True)
class ServedModel:
    """The result of resolving a request's `model` field."""

    name: str
    """The name as the client asked for it (echoed in the response's `model`)."""
    engine: Engine
    adapter: AdapterRef | None
    """None serves the bare base model."""
    step: int
    """Training step of the weights that serve it (0 for the base model)."""


class ModelRegistry(Protocol):
    def served_model_names(self) -> list[str]:
        """Names listed by GET /v1/models."""
        ...

    def resolve(self, model: str) -> ServedModel:
        """Map a request's `model` to weights; raises art.errors.ModelNotFoundError."""
        ...


class SingleModelRegistry:
    """Serves one engine's base model under one name (step 0, no adapter).

    The simplest real registry: enough for `art serve` of a bare model and for tests of the
    HTTP app; backends that train adapters provide their own.
    """

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name

    def served_model_names(self) -> list[str]:
        return [self.name]

    def resolve(self, model: str) -> ServedModel:
        if model != self.name:
            raise ModelNotFoundError(
                f"The model {echo(model)} does not exist; this server serves {self.served_model_names()}."
            )
        return ServedModel(name=model, engine=self.engine, adapter=None, step=0)

    def stats(self) -> dict[str, dict]:
        """The engine's load and time to first token, shown by GET /health."""
        stats = getattr(self.engine, "stats", None)
        return {self.name: stats()} if stats is not None else {}
