"""Which checkpoints a pipeline deletes: a strategy picks, among those it may delete, the ones to delete.

ART's contract: the pipeline never offers a strategy the latest step or a step an evaluation
still needs, and deletes exactly the steps the strategy returns
(`PipelineTrainer(checkpoint_retention_strategy=...)`). A strategy written for ART runs here as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime

from pydantic import BaseModel, Field

from art.errors import ArtValueError


class CheckpointInfo(BaseModel):
    step: int
    path: str
    created_at: datetime
    is_eval_step: bool = False
    """An evaluation was logged at this step."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """The step's history rows, each metric averaged over them."""


class CheckpointRetentionContext(BaseModel):
    current_step: int
    checkpoints: list[CheckpointInfo] = Field(default_factory=list)
    """The checkpoints the strategy may delete, oldest first."""


CheckpointRetentionStrategy = Callable[[CheckpointRetentionContext], Iterable[int]]
"""Returns the steps to delete among `context.checkpoints`; the others are kept."""


def keep_recent_and_top(*, recent: int = 5, top: int = 2, metric: str = "val/reward") -> CheckpointRetentionStrategy:
    """Delete every offered checkpoint but the `recent` newest and the `top` best by `metric`
    (ties: the later step)."""
    for name, value in (("recent", recent), ("top", top)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ArtValueError(f"{name} must be >= 0 (an int), got {value!r}", field=name)

    def strategy(context: CheckpointRetentionContext) -> set[int]:
        by_step = sorted(context.checkpoints, key=lambda c: c.step)
        keep = {c.step for c in by_step[len(by_step) - recent:]} if recent else set()
        ranked = sorted((c for c in by_step if metric in c.metrics), key=lambda c: (c.metrics[metric], c.step),
                        reverse=True)
        keep |= {c.step for c in ranked[:top]}
        return {c.step for c in by_step} - keep

    return strategy
