"""A PipelineTrainer's sizes, bounds and schedule, resolved from its keywords (ART's names) and checked
at once: every problem is named in one error."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from art.checks import int_at_least, one_of, positive_number
from art.pipeline_trainer.config import PipelineRuntimeConfig

RUNTIME_KEYWORDS = ("num_rollout_workers", "min_batch_size", "max_batch_size", "queue_maxsize")
"""`PipelineRuntimeConfig`'s fields, which ART also takes (deprecated) as the trainer's own keywords."""
STALE_GROUPS = ("drop", "wait")
"""What may happen to a group past `max_steps_off_policy` (`PipelineSettings.stale_groups`)."""


def runtime_config(
    pipeline: PipelineRuntimeConfig | None, direct: dict[str, Any]
) -> tuple[PipelineRuntimeConfig, dict[str, Any], list[str]]:
    """(the config as given, the deprecated direct settings that were set, problems): giving both
    is an error, the direct ones alone a DeprecationWarning (ART's behaviour)."""
    given = {name: value for name, value in direct.items() if value is not None}
    problems = []
    if pipeline is not None and given:
        problems.append(
            f"{', '.join(given)}: Use either pipeline=PipelineRuntimeConfig(...) or deprecated "
            "direct pipeline settings, not both."
        )
    elif given:
        warnings.warn(
            "Direct PipelineTrainer runtime settings are deprecated; pass pipeline=PipelineRuntimeConfig(...) instead.",
            DeprecationWarning,
            stacklevel=3,
        )
    return pipeline if isinstance(pipeline, PipelineRuntimeConfig) else PipelineRuntimeConfig(), given, problems


@dataclass(frozen=True)
class PipelineSettings:
    num_rollout_workers: int
    """Scenarios rolled out at once."""
    min_batch_size: int
    """Fewest groups a step trains (fewer only for the last batch, when the scenarios run out)."""
    max_batch_size: int | None
    """Most groups a step trains; None: 10 x min_batch_size (`batch_cap`)."""
    queue_maxsize: int | None
    """Finished groups that may wait for a batch before workers hold off; None: one batch per step
    a group may lag, at least one batch (`queue_limit`)."""
    max_steps_off_policy: int | None
    """The most steps a trained group may lag the policy it trains; None: unbounded."""
    limit_mean_steps_off_policy: float | None
    """The most a group's lag, averaged over its completion tokens, may be; None: no limit."""
    stale_groups: str
    """What happens to a group past `max_steps_off_policy`: "drop" it, or "wait" for it."""
    max_steps: int | None
    """Steps to train in this call; None: until the scenarios run out."""
    discard_queue_multiplier: int
    """Training stops after this many x min_batch_size groups in a row without signal."""
    eval_every_n_steps: int
    """Evaluate every this many steps; 0: never (the start step aside)."""
    checkpoint_retention_interval: int
    """Apply the retention strategy every this many steps."""
    total_scenarios: int | None
    """How many scenarios there are, for the progress line; None: unknown."""
    log_interval_seconds: float
    """Seconds between status lines."""

    def problems(self) -> list[str]:
        """Every setting that is out of range, as "name must be ..., got ..."."""
        counts = [
            int_at_least(name, getattr(self, name), low, none_ok=none_ok)
            for name, low, none_ok in (
                ("num_rollout_workers", 1, False),
                ("min_batch_size", 1, False),
                ("max_batch_size", 1, True),
                ("max_steps_off_policy", 0, True),
                ("queue_maxsize", 1, True),
                ("max_steps", 0, True),
                ("discard_queue_multiplier", 1, False),
                ("eval_every_n_steps", 0, False),
                ("checkpoint_retention_interval", 1, False),
                ("total_scenarios", 0, True),
            )
        ]
        low, high = self.min_batch_size, self.max_batch_size
        crossed = isinstance(high, int) and isinstance(low, int) and high < low
        waits_for_nothing = self.stale_groups == "wait" and self.max_steps_off_policy is None
        problems = [
            *counts,
            f"max_batch_size ({high}) must be >= min_batch_size ({low})" if crossed else None,
            one_of("stale_groups", self.stale_groups, STALE_GROUPS),
            "stale_groups='wait' needs a max_steps_off_policy to wait for" if waits_for_nothing else None,
            positive_number("log_interval_seconds", self.log_interval_seconds),
        ]
        return [problem for problem in problems if problem]

    @property
    def batch_cap(self) -> int:
        """Groups a step trains at most."""
        return self.max_batch_size if self.max_batch_size is not None else 10 * self.min_batch_size

    @property
    def age_bound(self) -> int | None:
        """The lag the rollout gate plans for: the hard bound, else the mean limit rounded up."""
        if self.max_steps_off_policy is not None:
            return self.max_steps_off_policy
        limit = self.limit_mean_steps_off_policy
        return math.ceil(limit) if limit is not None else None

    @property
    def queue_limit(self) -> int:
        """Finished groups that may wait for a batch."""
        return self.queue_maxsize or max(self.batch_cap, (self.age_bound or 1) * self.batch_cap)
