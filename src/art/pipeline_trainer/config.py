"""`PipelineRuntimeConfig`: how much a `PipelineTrainer` runs at once, under ART's 2026 names.

`PipelineTrainer(pipeline=PipelineRuntimeConfig(...))` is ART's current way to size the pipeline;
the same four settings passed to the trainer directly are ART's deprecated spelling (they still
work, with a DeprecationWarning; both at once is an error). How stale a trained group may be is
not sized here: `max_steps_off_policy` and `limit_mean_steps_off_policy` stay trainer keywords.
"""

from __future__ import annotations

import pydantic

from art.checks import int_at_least, number_at_least, positive_number
from art.numeric import is_number


class PipelineRuntimeConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    num_rollout_workers: int = pydantic.Field(default=16, ge=1)
    """Scenarios rolled out at once."""
    min_batch_size: int = pydantic.Field(default=4, ge=1)
    """Groups a step waits for before it trains."""
    max_batch_size: int | None = pydantic.Field(default=None, ge=1)
    """Most groups one step trains; None: 10 x min_batch_size."""
    queue_maxsize: int | None = pydantic.Field(default=None, ge=1)
    """Finished groups that may wait for a batch before workers hold off; None: one batch per
    step a group may lag (max_steps_off_policy x max_batch_size, at least one batch)."""
    score_reference_groups_per_step: float | None = pydantic.Field(default=8.0, gt=0.0)
    """ART's reference batch for its `objective/score` metric; accepted, not used here."""
    score_reference_rollouts_per_group: float | None = pydantic.Field(default=None, gt=0.0)
    """Likewise ART's; accepted, not used here."""

    @pydantic.model_validator(mode="after")
    def _batch_bounds(self) -> PipelineRuntimeConfig:
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError("max_batch_size must be >= min_batch_size")
        return self


def check_art_keywords(
    *,
    pipeline,
    autotune,
    rollout_executor,
    limit_mean_steps_off_policy,
    kl_penalty_coef,
    kl_penalty_step_lag,
    grad_accumulation_sequences,
    optimizer_save_interval,
    score_reference_groups_per_step,
    score_reference_rollouts_per_group,
) -> list[str]:
    """What is wrong with the `PipelineTrainer` keywords ART added in 2026, one line each, each
    starting with the keyword's name (ART's bounds, in `art.checks`' words)."""
    problems = []
    if pipeline is not None and not isinstance(pipeline, PipelineRuntimeConfig):
        problems.append(f"pipeline must be a PipelineRuntimeConfig, got {type(pipeline).__name__}")
    if autotune is not None and getattr(autotune, "mode", "off") != "off":
        problems.append(
            f"autotune: pipeline autotuning (mode {getattr(autotune, 'mode', None)!r}) is not available "
            "here; size the pipeline with pipeline=PipelineRuntimeConfig(...)"
        )
    if rollout_executor is not None:
        problems.append(
            "rollout_executor: distributed rollout executors are not available here; rollouts run "
            "as tasks of the trainer's event loop"
        )
    bounds = [
        number_at_least("limit_mean_steps_off_policy", limit_mean_steps_off_policy, 0, none_ok=True),
        positive_number("score_reference_groups_per_step", score_reference_groups_per_step, none_ok=True),
        positive_number("score_reference_rollouts_per_group", score_reference_rollouts_per_group, none_ok=True),
        int_at_least("kl_penalty_step_lag", kl_penalty_step_lag, 1, none_ok=True),
        int_at_least("grad_accumulation_sequences", grad_accumulation_sequences, 1, none_ok=True),
        int_at_least("optimizer_save_interval", optimizer_save_interval, 1),
    ]
    problems += [problem for problem in bounds if problem]
    if not is_number(kl_penalty_coef) or kl_penalty_coef != 0:
        problems.append(
            f"kl_penalty_coef must be 0.0 here, got {kl_penalty_coef!r}: the KL-penalised advantage "
            "is not available (use the loss's KL term, train option beta)"
        )
    return problems
