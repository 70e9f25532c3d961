"""Every history of a trajectory, whichever API its calls used (`Trajectory.histories()`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .completions_histories import completions_string_histories, completions_token_histories
from .histories import (
    TrajectoryLike,
    anthropic_messages_histories,
    chat_completions_histories,
    responses_histories,
)
from .history_sources import model_selected, only


def trajectory_histories(trajectory: TrajectoryLike, *, model: str | None) -> list[Any]:
    """Every history of the one API the (selected) exchanges used; the legacy histories
    (`messages_and_choices` and `additional_histories`) of a trajectory without exchanges."""
    if not trajectory.exchanges:
        return trajectory.legacy_histories()
    every = trajectory.exchanges
    exact = model is not None and any(e.model == model for e in every.in_order())

    def chosen(exchanges: Iterable[Any]) -> bool:
        return any(model_selected(e.model, model, exact) for e in exchanges)

    found: list[Any] = []
    if chosen(every.chat_completions):
        found += chat_completions_histories(trajectory, model=model)
    if chosen(every.completions):
        try:
            found += completions_token_histories(trajectory, model=model)
        except ValueError as exc:
            if "requires exact token IDs" not in str(exc):
                raise
            found += completions_string_histories(trajectory, model=model)
    if chosen(every.responses):
        found += responses_histories(trajectory, model=model)
    if chosen(every.messages):
        found += anthropic_messages_histories(trajectory, model=model)
    if not found:
        raise ValueError("Trajectory contains no exchanges" + (f" for model {model!r}" if model is not None else ""))
    if len({type(h) for h in found}) != 1:
        raise ValueError("Trajectory resolves to multiple protocol histories; use a protocol-specific method")
    return found


def trajectory_history(trajectory: TrajectoryLike, *, model: str | None) -> Any:
    return only(trajectory_histories(trajectory, model=model), "Trajectory history", model)
