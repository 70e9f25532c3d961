"""What a pipeline step's row reports beside the update's own metrics: the groups it trained, how
far off policy they were, what was discarded, and where the interval's wall time went (ART's
`data/`, `offpolicy/`, `discarded/`, `time/` and `throughput/` names)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from art.pipeline_trainer.staleness import lag_weights
from art.pipeline_trainer.state import PipelineState
from art.trajectories import TrajectoryGroup


@dataclass
class FinishedGroup:
    """A finished group waiting for a batch."""

    index: int
    """The scenario's position in the scenario stream."""
    group: TrajectoryGroup
    version: int
    """The policy step of its oldest turn."""
    rollout_s: float


@dataclass
class Interval:
    """What happened from the end of one training step to the end of the next (the next step's
    `time/`, `throughput/` and `discarded/step/` metrics), as ART counts a step's wall time."""

    started: float = field(default_factory=time.monotonic)
    rollout_s: float = 0.0
    rollout_idle_s: float = 0.0
    rollouts: int = 0
    completion_tokens: int = 0
    stale: int = 0
    zero_variance: int = 0
    waited: int = 0


def step_metrics(
    step: int, batch: list[FinishedGroup], interval: Interval, state: PipelineState, *, idle_s: float, train_s: float
) -> dict[str, float]:
    """The `data/`, `offpolicy/`, `discarded/`, `time/` and `throughput/` metrics of step `step`,
    trained on `batch` at the end of `interval`; `idle_s` the trainer waited for it, `train_s` it
    trained."""
    lags = [step - item.version for item in batch]
    weights = [pair for item in batch for pair in lag_weights(step, item.group, item.version)]
    wall = time.monotonic() - interval.started
    trajectories = sum(len(item.group.trajectories) for item in batch)
    return {
        "data/step_num_groups_trainable": float(len(batch)),
        "data/step_num_groups_submitted": float(len(batch) + interval.stale + interval.zero_variance),
        "data/step_num_trajectories": float(trajectories),
        "offpolicy/steps_off_policy_mean": sum(lags) / len(lags),
        "offpolicy/steps_off_policy_max": float(max(lags)),
        "offpolicy/token_weighted_policy_age_steps": sum(a * w for a, w in weights) / sum(w for _, w in weights),
        "offpolicy/dropped_groups": float(interval.stale),
        "offpolicy/cum/dropped_groups": float(state.discarded_stale_groups),
        "offpolicy/waited_groups": float(interval.waited),
        "discarded/step/stale_groups": float(interval.stale),
        "discarded/cum/stale_groups": float(state.discarded_stale_groups),
        "discarded/step/zero_variance_groups": float(interval.zero_variance),
        "discarded/cum/zero_variance_groups": float(state.discarded_zero_variance_groups),
        "time/step_wall_s": wall,
        "time/step_trainer_idle_s": idle_s,
        "time/step_backend_train_s": train_s,
        "time/step_trainer_s": train_s,
        "time/step_rollout_s": interval.rollout_s,
        "time/step_rollout_idle_s": interval.rollout_idle_s,
        "throughput/rollout_completion_tokens_per_s": interval.completion_tokens / wall if wall > 0 else 0.0,
        "throughput/rollouts_per_s": interval.rollouts / wall if wall > 0 else 0.0,
        "throughput/trainer_busy_fraction": train_s / wall if wall > 0 else 0.0,
    }
