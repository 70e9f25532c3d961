"""`SingleModelRegistry`: the smallest `art.server.registry.ModelRegistry`, for tests of the HTTP app."""

from __future__ import annotations

from art.engine.base import Engine, ServedModel
from art.errors import ModelNotFoundError
from art.naming import echo


class SingleModelRegistry:
    """Serves one engine's base model under one name (step 0, no adapter).

    The simplest real registry: enough for tests of the HTTP app; backends that train
    adapters provide their own.
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
