"""`PipelineTrainer`'s keywords (ART's names) resolved at once: the settings it runs by and the runtime
config it reports, or one ArtValueError naming every problem (its `field` the first one's keyword);
and `ArtAttributes`, the same names read back from the settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from art.errors import ArtValueError
from art.pipeline_trainer.config import PipelineRuntimeConfig, check_art_keywords
from art.pipeline_trainer.settings import RUNTIME_KEYWORDS, PipelineSettings


class ArtAttributes:
    """The trainer's settings read back under ART's attribute names; read-only, as the settings were
    checked together when the trainer was built."""

    settings: PipelineSettings

    @property
    def num_rollout_workers(self) -> int:
        """Scenarios rolled out at once."""
        return self.settings.num_rollout_workers

    @property
    def min_batch_size(self) -> int:
        """Fewest groups a step trains (fewer only for the last batch)."""
        return self.settings.min_batch_size

    @property
    def max_batch_size(self) -> int:
        """Most groups a step trains, resolved: 10 x min_batch_size when none was given."""
        return self.settings.batch_cap

    @property
    def queue_maxsize(self) -> int:
        """Finished groups that may wait for a batch, resolved (`PipelineSettings.queue_limit`)."""
        return self.settings.queue_limit

    @property
    def max_steps_off_policy(self) -> int | None:
        """The most steps a trained group may lag the policy it trains; None: unbounded."""
        return self.settings.max_steps_off_policy

    @property
    def limit_mean_steps_off_policy(self) -> float | None:
        """The most a group's token-weighted mean lag may be; None: no limit."""
        return self.settings.limit_mean_steps_off_policy

    @property
    def stale_groups(self) -> str:
        """What happens to a group past `max_steps_off_policy`: "drop" it, or "wait" for it."""
        return self.settings.stale_groups

    @property
    def max_steps(self) -> int | None:
        """Steps to train in one `train` call; None: until the scenarios run out."""
        return self.settings.max_steps

    @property
    def discard_queue_multiplier(self) -> int:
        """Training stops after this many x min_batch_size groups in a row without signal."""
        return self.settings.discard_queue_multiplier

    @property
    def collapse_after(self) -> int:
        """Groups in a row without signal that stop training as a collapse."""
        return self.settings.discard_queue_multiplier * self.settings.min_batch_size

    @property
    def log_interval_seconds(self) -> float:
        """Seconds between status lines."""
        return float(self.settings.log_interval_seconds)

    @property
    def total_scenarios(self) -> int | None:
        """How many scenarios there are, for the status line; None: unknown."""
        return self.settings.total_scenarios

    @property
    def eval_every_n_steps(self) -> int:
        """Evaluate every this many steps; 0: never (the start step aside)."""
        return self.settings.eval_every_n_steps

    @property
    def checkpoint_retention_interval(self) -> int:
        """Apply the retention strategy every this many steps."""
        return self.settings.checkpoint_retention_interval


@dataclass(frozen=True)
class ResolvedKeywords:
    """What the trainer keeps of its keywords once they are all known to be good."""

    settings: PipelineSettings
    """What the trainer runs by."""
    pipeline: PipelineRuntimeConfig
    """The runtime config as ART reports it: the one given, with the deprecated direct sizes in it."""
    score_reference_groups_per_step: float | None
    """ART's, the trainer's keyword else the config's; accepted, not used here."""
    score_reference_rollouts_per_group: float | None
    """Likewise."""


def resolve_keywords(
    sized: tuple[PipelineRuntimeConfig, dict[str, Any], list[str]],  # `runtime_config`'s answer, asked by the caller
    *,
    rollout_fn: object,
    eval_fn: object | None,
    pipeline: PipelineRuntimeConfig | None,
    autotune: object | None,
    rollout_executor: object | None,
    limit_mean_steps_off_policy: float | None,
    kl_penalty_coef: float,
    kl_penalty_step_lag: int | None,
    grad_accumulation_sequences: int | None,
    optimizer_save_interval: int,
    score_reference_groups_per_step: float | None,
    score_reference_rollouts_per_group: float | None,
    max_steps_off_policy: int | None,
    stale_groups: str,
    max_steps: int | None,
    discard_queue_multiplier: int,
    eval_every_n_steps: int,
    checkpoint_retention_interval: int,
    total_scenarios: int | None,
    log_interval_seconds: float,
) -> ResolvedKeywords:
    """Check every keyword before any is used, so one error names all that is wrong."""
    problems = check_art_keywords(
        pipeline=pipeline,
        autotune=autotune,
        rollout_executor=rollout_executor,
        limit_mean_steps_off_policy=limit_mean_steps_off_policy,
        kl_penalty_coef=kl_penalty_coef,
        kl_penalty_step_lag=kl_penalty_step_lag,
        grad_accumulation_sequences=grad_accumulation_sequences,
        optimizer_save_interval=optimizer_save_interval,
        score_reference_groups_per_step=score_reference_groups_per_step,
        score_reference_rollouts_per_group=score_reference_rollouts_per_group,
    )
    config_given, aliases, alias_problems = sized
    sizes = {name: aliases.get(name, getattr(config_given, name)) for name in RUNTIME_KEYWORDS}
    settings = PipelineSettings(
        **sizes,
        max_steps_off_policy=max_steps_off_policy,
        limit_mean_steps_off_policy=limit_mean_steps_off_policy,
        stale_groups=stale_groups,
        max_steps=max_steps,
        discard_queue_multiplier=discard_queue_multiplier,
        eval_every_n_steps=eval_every_n_steps,
        checkpoint_retention_interval=checkpoint_retention_interval,
        total_scenarios=total_scenarios,
        log_interval_seconds=log_interval_seconds,
    )
    problems += alias_problems + settings.problems() + function_problems(rollout_fn, eval_fn)
    if problems:
        field_name = problems[0].split(" ", 1)[0].rstrip(":,")
        raise ArtValueError("invalid PipelineTrainer settings: " + "; ".join(problems), field=field_name)
    return ResolvedKeywords(
        settings,
        PipelineRuntimeConfig(**{**config_given.model_dump(exclude_unset=True), **aliases}),
        first_given(score_reference_groups_per_step, config_given.score_reference_groups_per_step),
        first_given(score_reference_rollouts_per_group, config_given.score_reference_rollouts_per_group),
    )


def function_problems(rollout_fn: object, eval_fn: object | None) -> list[str]:
    """The trainer's functions are checked with its keywords, so their problems join the one error."""
    problems = []
    if not callable(rollout_fn):
        problems.append("rollout_fn must be an async function (model, scenario, config) -> TrajectoryGroup")
    if eval_fn is not None and not callable(eval_fn):
        problems.append("eval_fn must be an async function (model, step, config) or None")
    return problems


def first_given(value: float | None, default: float | None) -> float | None:
    """A keyword left at None takes the runtime config's value instead."""
    return value if value is not None else default
