"""One scenario's rollout as the pipeline runs it, apart from the pipeline's counting: which
scenarios are left, the user's `rollout_fn` awaited to a group, and the group dated by the policy
steps that sampled it."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

from art.pipeline_trainer.state import PipelineState
from art.pipeline_trainer.types import RolloutFn
from art.trajectories import TrajectoryGroup, policy_versions


async def unused_scenarios(scenarios: Any, state: PipelineState) -> AsyncIterator[tuple[int, Any]]:
    """(index, scenario) of every scenario, sync or async iterable, not used up yet (a resumed run
    skips those); the index counts every scenario, so it stays the same across a resume."""
    index = 0
    if hasattr(scenarios, "__aiter__"):  # an async iterable (every AsyncIterator is one)
        async for scenario in scenarios:
            if not state.is_used(index):
                yield index, scenario
            index += 1
        return
    for scenario in scenarios:
        if not state.is_used(index):
            yield index, scenario
        index += 1


async def rollout_group(rollout_fn: RolloutFn, model: Any, scenario: Any, config: Any) -> TrajectoryGroup:
    """The group `rollout_fn` makes of one scenario, whether it returns the group, an awaitable of
    it, or a group still built of coroutines; anything else is a TypeError naming what it was."""
    group = rollout_fn(model, scenario, config)
    if inspect.isawaitable(group) and not isinstance(group, TrajectoryGroup):
        group = await group
    if isinstance(group, TrajectoryGroup) and group.pending:  # built from coroutines: run them
        group = await group
    if not isinstance(group, TrajectoryGroup):
        raise TypeError(f"rollout_fn returned {type(group).__name__}, expected a TrajectoryGroup")
    return group


def date_group(group: TrajectoryGroup, started: int, policy: int) -> int:
    """Date each trajectory by the steps its choices were sampled at (else the policy between the
    rollout's start and now); the group is as old as its oldest trajectory."""
    oldest = []
    for trajectory in group.trajectories:
        initial, final = policy_versions(trajectory, started, policy)
        trajectory.initial_policy_version, trajectory.final_policy_version = initial, final
        oldest.append(initial)
    return min(oldest, default=started)
