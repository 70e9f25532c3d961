"""How far behind the trained step the policy that sampled a group is: the arithmetic
`max_steps_off_policy` and `limit_mean_steps_off_policy` bound, and the step metrics report."""

from __future__ import annotations

from art.trajectories import TrajectoryGroup, completion_tokens


def mean_steps_off_policy(group: TrajectoryGroup, step: int, default_version: int) -> float:
    """How many steps behind `step` the policy that sampled `group` is, on average over its
    completion tokens (what `limit_mean_steps_off_policy` bounds): each trajectory lags from
    its `initial_policy_version` (else `default_version`), weighted by its completion tokens
    (at least 1). A group without trajectories lags `step - default_version`."""
    pairs = lag_weights(step, group, default_version)
    return sum(a * w for a, w in pairs) / sum(w for _, w in pairs) if pairs else float(step - default_version)


def lag_weights(step: int, group: TrajectoryGroup, default_version: int) -> list[tuple[int, int]]:
    """(lag behind `step`, completion tokens) of each trajectory of a group."""
    return [
        (
            step - (t.initial_policy_version if t.initial_policy_version is not None else default_version),
            max(1, completion_tokens(t)),
        )
        for t in group.trajectories
    ]
