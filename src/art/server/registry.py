"""What the HTTP app needs from whoever holds the models: name resolution, nothing else.

The app holds no model state; a backend hands it an object with this shape.
"""

from __future__ import annotations

from typing import Protocol

from art.engine.base import ServedModel


class ModelRegistry(Protocol):
    def served_model_names(self) -> list[str]:
        """Names listed by GET /v1/models."""
        ...

    def resolve(self, model: str) -> ServedModel:
        """Map a request's `model` to weights; raises art.errors.ModelNotFoundError."""
        ...
