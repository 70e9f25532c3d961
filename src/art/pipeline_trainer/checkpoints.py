"""The pipeline's checkpoint bookkeeping on the backend: ART's `checkpoint/*` history rows, and
deleting the steps that `save_checkpoint=False` or a retention strategy lets go."""

from __future__ import annotations

from typing import Any

from art.pipeline_trainer.checkpoint_retention import (
    CheckpointRetentionStrategy,
    checkpoint_infos,
    plan_checkpoint_retention,
)


async def log_checkpoint(backend: Any, model: Any, step: int, metrics: dict[str, float]) -> None:
    """A history row of its own for a checkpoint fact (ART's `checkpoint/*` rows): history only,
    not W&B, and not routed under a split."""
    await backend.log(model, split="train", step=step, metrics=metrics, groups=[])


async def retain_checkpoints(
    backend: Any,
    model: Any,
    step: int,
    *,
    save_checkpoint: bool,
    strategy: CheckpointRetentionStrategy | None,
    interval: int,
    protected: set[int],
    completed_eval_steps: list[int],
) -> None:
    """After step `step` is saved: delete what `save_checkpoint=False` or the retention strategy
    (every `interval` steps) lets go; never `step` or a `protected` one (an evaluation needs it)."""
    if save_checkpoint and (strategy is None or step % interval):
        return
    protected = {step} | protected
    steps = await backend.list_checkpoints(model)
    eligible = [s for s in steps if s not in protected]
    if not eligible:
        return
    keep = set(steps) - set(eligible)
    if save_checkpoint and strategy is not None:  # ART's contract: the strategy's plan names what stays
        infos = checkpoint_infos(await backend.get_history(model), steps, completed_eval_steps)
        plan = plan_checkpoint_retention(
            current_step=step, checkpoints=infos, protected_steps=protected, strategy=strategy
        )
        if plan is None:
            return
        keep = plan.retain_steps | plan.archive_steps
    if set(steps) - keep:
        await backend.delete_checkpoints(model, keep_steps=sorted(keep))
