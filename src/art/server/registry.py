"""What the HTTP app needs from whoever holds the models: name resolution and their load.

The app holds no model state; a backend hands it an object with this shape.
"""

from __future__ import annotations

from typing import Any, Protocol

from art.engine.base import ServedModel


class ModelRegistry(Protocol):
    def served_model_names(self) -> list[str]:
        """Names listed by GET /v1/models."""
        ...

    def resolve(self, model: str) -> ServedModel:
        """Map a request's `model` to weights; raises art.errors.ModelNotFoundError."""
        ...

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each model's engine load for GET /health (`ManagedEngine.stats`, with its replicas'):
        an `engine_down` entry says that engine cannot serve, `replicas` lists its replicas."""
        ...
