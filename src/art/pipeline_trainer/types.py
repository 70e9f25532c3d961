"""The user functions `PipelineTrainer` calls, typed with ART's names, and the adapter from one
rollout to a group of them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from art.trajectories import Trajectory, TrajectoryGroup

ScenarioT = TypeVar("ScenarioT")
ConfigT = TypeVar("ConfigT")

RolloutFn = Callable[[Any, ScenarioT, ConfigT], Awaitable[TrajectoryGroup]]
"""`rollout_fn(model, scenario, config)`: one group of rollouts of one scenario."""
SingleRolloutFn = Callable[[Any, ScenarioT, ConfigT], Awaitable[Trajectory]]
"""One rollout; `make_group_rollout_fn` runs it n times as a group."""
EvalItems = Sequence[Trajectory | TrajectoryGroup]
EvalFn = Callable[[Any, int, ConfigT], Awaitable[EvalItems | Mapping[str, EvalItems]]]
"""`eval_fn(model, step, config)`: trajectories (logged as "val") or {split: trajectories}."""


def make_group_rollout_fn(
    single_rollout_fn: SingleRolloutFn[ScenarioT, ConfigT], n: int = 4
) -> RolloutFn[ScenarioT, ConfigT]:
    """A `rollout_fn` that runs `single_rollout_fn(model, scenario, config)` n times at once as
    one group; a rollout that raises is kept in the group's `exceptions`."""

    async def group_rollout(model, scenario: ScenarioT, config: ConfigT) -> TrajectoryGroup:
        if n <= 0:
            return TrajectoryGroup([])
        return await TrajectoryGroup(single_rollout_fn(model, scenario, config) for _ in range(n))

    return group_rollout
