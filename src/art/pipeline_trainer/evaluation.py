"""Evaluations beside training: `eval_fn(model, step, config)` queued by step, run one at a time on
the pipeline's event loop, logged at their step (one split per key when it returns a mapping), and
recorded as ART's `checkpoint/eval_completed` row. One that raises is logged; training goes on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from art.errors import ArtValueError
from art.pipeline_trainer.broadcast import Broadcast
from art.pipeline_trainer.checkpoint_retention import CHECKPOINT_EVAL_COMPLETED_METRIC
from art.pipeline_trainer.checkpoints import log_checkpoint
from art.pipeline_trainer.state import STATE_KEY, PipelineState
from art.pipeline_trainer.types import EvalFn
from art.trajectories import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


def metrics_context(model: Any, name: str) -> Any:
    """As ART's pipeline: API costs of rollouts go to the "train" row, of evaluations to the "val"
    one (`Model.activate_metrics_context`); a token to reset, or None for a model without it."""
    activate = getattr(model, "activate_metrics_context", None)
    return activate(name) if callable(activate) else None


class Evaluations:
    def __init__(
        self,
        model: Any,
        backend: Any,
        eval_fn: EvalFn,
        config: Any,
        state: PipelineState,
        *,
        every_n_steps: int,
        changes: Broadcast,
    ) -> None:
        self.model, self.backend, self.eval_fn, self.config, self.state = model, backend, eval_fn, config, state
        self.every_n_steps = every_n_steps
        self.changes = changes
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self.pending: set[int] = set()
        """Steps queued or being evaluated: their checkpoints must stay."""

    def due(self, step: int) -> bool:
        """`every_n_steps` have passed since the last evaluation."""
        return self.every_n_steps > 0 and step - self.state.last_eval_step >= self.every_n_steps

    def schedule(self, step: int) -> None:
        if step not in self.pending:
            self.pending.add(step)
            self.state.last_eval_step = step
            self.queue.put_nowait(step)

    async def run(self, stopped: Callable[[], bool]) -> None:
        """One evaluation at a time until `stopped()`; then what is still queued."""
        while not (stopped() and self.queue.empty()):
            if self.queue.empty():
                await self.changes.wait()
                continue
            await self.evaluate(self.queue.get_nowait())

    async def evaluate(self, step: int) -> None:
        began = time.monotonic()
        try:
            costs = metrics_context(self.model, "eval")
            try:
                result = await self.eval_fn(self.model, step, self.config)
            finally:
                if costs is not None:
                    costs.var.reset(costs)
            splits = result if isinstance(result, Mapping) else {"val": result}
            timing: dict[str, float] | None = {"time/step_eval_s": time.monotonic() - began}
            for split, items in splits.items():
                groups = as_groups(items, split)
                if groups:
                    await self.model.log(groups, split=split, step=step, metrics=timing)
                    timing = None
            if timing is not None:
                await self.model.log(split="val", step=step, metrics=timing)
            await log_checkpoint(self.backend, self.model, step, {CHECKPOINT_EVAL_COMPLETED_METRIC: 1.0})
            self.state.completed_eval_steps = sorted(set(self.state.completed_eval_steps) | {step})
            self.model.merge_state({STATE_KEY: self.state.saved()})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an evaluation never stops training
            log.warning("evaluation at step %d failed: %s: %s", step, type(exc).__name__, exc)
        finally:
            self.pending.discard(step)
            self.changes.notify()


def as_groups(items: Any, split: str) -> list[TrajectoryGroup]:
    """What `eval_fn` returned for one split as groups (loose trajectories make one group)."""
    items = list(items or [])
    groups = [item for item in items if isinstance(item, TrajectoryGroup)]
    loose = [item for item in items if isinstance(item, Trajectory)]
    if len(groups) + len(loose) != len(items):
        raise ArtValueError(f"eval_fn's {split!r} items must be Trajectory or TrajectoryGroup objects", field="eval_fn")
    return groups + ([TrajectoryGroup(loose)] if loose else [])
