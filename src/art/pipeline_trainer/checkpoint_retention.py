"""Which checkpoints a pipeline keeps: a strategy sees every checkpoint and names the ones to keep.

ART's newest contract: a strategy returns a `CheckpointRetentionPlan` (`retain_steps`, and
`archive_steps` to set aside). A bare set of steps is refused, not read: ART's releases disagreed
on whether it named the steps to keep or to delete, and a wrong guess deletes checkpoints. The
pipeline deletes the checkpoints it may delete (`deletion_eligible`: never the latest step or one
an evaluation still needs) that the plan does not retain. Here, with no store to archive to, an
archived step stays in the run folder. A strategy written for ART runs here as is
(`PipelineTrainer(checkpoint_retention_strategy=...)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, Field

from art.errors import ArtValueError
from art.numeric import is_finite, is_int

CHECKPOINT_SAVED_METRIC = "checkpoint/saved"
CHECKPOINT_CREATED_AT_METRIC = "checkpoint/created_at_unix"
"""When the step's checkpoint was written (Unix seconds): `CheckpointInfo.created_at`."""
CHECKPOINT_EVAL_COMPLETED_METRIC = "checkpoint/eval_completed"
"""1.0 once an evaluation of the step's checkpoint finished: `CheckpointInfo.is_eval_step`.

The pipeline writes these three in history rows of their own (ART's names and row shape: the
step, `training_step` and `recorded_at` beside them), so a strategy sees the same facts after a
restart, and ART's readers of `history.jsonl` read ours."""


class CheckpointInfo(BaseModel):
    step: int
    path: str | None = None
    created_at: datetime
    deletion_eligible: bool = False
    """The pipeline may delete it: not the latest step, nor one an evaluation still needs."""
    is_eval_step: bool = False
    """An evaluation was logged at this step."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """The step's history rows, each metric averaged over them."""


class CheckpointRetentionContext(BaseModel):
    current_step: int
    checkpoints: list[CheckpointInfo] = Field(default_factory=list)
    """Every checkpoint of the run, oldest first."""


class CheckpointRetentionPlan(BaseModel):
    observed_steps: set[int] = Field(default_factory=set)
    """The steps the plan was made from (set by `plan_checkpoint_retention`)."""
    retain_steps: set[int] = Field(default_factory=set)
    """The steps to keep; an eligible step not named here is deleted."""
    archive_steps: set[int] = Field(default_factory=set)
    """Steps to set aside for good (kept in the run folder here)."""


CheckpointRetentionStrategy = Callable[[CheckpointRetentionContext], CheckpointRetentionPlan]


def plan_checkpoint_retention(
    *,
    current_step: int,
    checkpoints: list[CheckpointInfo],
    protected_steps: set[int],
    strategy: CheckpointRetentionStrategy,
) -> CheckpointRetentionPlan | None:
    """The strategy's plan over `checkpoints` (those in `protected_steps` not deletable), with
    `retain_steps` every step that stays; None when nothing is to be deleted or archived."""
    known = {c.step for c in checkpoints}
    eligible = known - protected_steps
    answer = strategy(
        CheckpointRetentionContext(
            current_step=current_step,
            checkpoints=[c.model_copy(update={"deletion_eligible": c.step in eligible}) for c in checkpoints],
        )
    )
    if not isinstance(answer, CheckpointRetentionPlan):
        raise ArtValueError(
            f"checkpoint_retention_strategy must return a CheckpointRetentionPlan(retain_steps=...), got "
            f"{type(answer).__name__}: bare steps are refused, since ART's releases read them as the steps "
            "to keep in one and to delete in another",
            field="checkpoint_retention_strategy",
        )
    plan = answer
    unknown = (plan.retain_steps | plan.archive_steps) - known
    if unknown:
        raise ArtValueError(
            f"checkpoint retention selected unknown steps: {sorted(unknown)}", field="checkpoint_retention_strategy"
        )
    delete = eligible - plan.retain_steps - plan.archive_steps
    if not delete and not plan.archive_steps:
        return None
    return plan.model_copy(update={"observed_steps": known, "retain_steps": known - delete})


def _limit(name: str, value: object, least: int = 0) -> None:
    if not is_int(value) or value < least:
        raise ArtValueError(f"{name} must be >= {least} (an int), got {value!r}", field=name)


def keep_recent_and_top(*, recent: int = 5, top: int = 2, metric: str = "val/reward") -> CheckpointRetentionStrategy:
    """Keep the `recent` newest checkpoints and the `top` best by `metric` (ties: the later step).
    The default is our history's name of the validation reward (ART's rows call it `reward/val`)."""
    _limit("recent", recent)
    _limit("top", top)

    def strategy(context: CheckpointRetentionContext) -> CheckpointRetentionPlan:
        by_step = sorted(context.checkpoints, key=lambda c: c.step)
        keep = {c.step for c in by_step[len(by_step) - recent :]} if recent else set()
        ranked = sorted(
            (c for c in by_step if metric in c.metrics), key=lambda c: (c.metrics[metric], c.step), reverse=True
        )
        keep |= {c.step for c in ranked[:top]}
        return CheckpointRetentionPlan(retain_steps=keep)

    return strategy


def keep_recent_and_periodic(
    *,
    recent: int = 5,
    archive_interval: int = 25,
    archives: int = 2,
) -> CheckpointRetentionStrategy:
    """Keep the `recent` newest checkpoints and archive the last `archives` steps that are
    multiples of `archive_interval` (step 0 never)."""
    _limit("recent", recent)
    _limit("archives", archives)
    _limit("archive_interval", archive_interval, least=1)

    def strategy(context: CheckpointRetentionContext) -> CheckpointRetentionPlan:
        by_step = sorted(c.step for c in context.checkpoints)
        periodic = [step for step in by_step if step > 0 and step % archive_interval == 0]
        return CheckpointRetentionPlan(
            retain_steps=set(by_step[len(by_step) - recent :]) if recent else set(),
            archive_steps=set(periodic[len(periodic) - archives :]) if archives else set(),
        )

    return strategy


def checkpoint_infos(
    history: Iterable[Mapping[str, Any]], steps: list[int], completed_eval_steps: Iterable[int] = ()
) -> list[CheckpointInfo]:
    """What a strategy knows of each step, from the run's history rows: every numeric metric
    averaged over the step's rows (ART's), when its checkpoint was written and whether an
    evaluation of it finished (`completed_eval_steps`, `checkpoint/*`, else a `val/` or `test/`
    metric)."""
    evaluated = set(completed_eval_steps)
    sums: dict[int, dict[str, list[float]]] = {}
    for row in history:
        at = row.get("step")
        if type(at) is int and at in steps:
            for key, value in row.items():
                if key not in ("step", "recorded_at") and is_finite(value):
                    sums.setdefault(at, {}).setdefault(key, []).append(float(value))
    out = []
    for at in sorted(steps):
        metrics = {k: sum(v) / len(v) for k, v in sums.get(at, {}).items()}
        created = metrics.get(CHECKPOINT_CREATED_AT_METRIC)
        out.append(
            CheckpointInfo(
                step=at,
                path=f"checkpoints/{at:04d}",
                created_at=datetime.fromtimestamp(created, timezone.utc)
                if created is not None
                else datetime.now(timezone.utc),
                is_eval_step=(
                    at in evaluated
                    or metrics.get(CHECKPOINT_EVAL_COMPLETED_METRIC, 0.0) > 0.0
                    or any(k.startswith(("val/", "test/")) for k in metrics)
                ),
                metrics=metrics,
            )
        )
    return out
