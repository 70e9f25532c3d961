"""The user functions `PipelineTrainer` calls, typed with ART's names."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, Union

from art.trajectories import Trajectory, TrajectoryGroup

ScenarioT = TypeVar("ScenarioT")
ConfigT = TypeVar("ConfigT")

RolloutFn = Callable[[Any, ScenarioT, ConfigT], Awaitable[TrajectoryGroup]]
"""`rollout_fn(model, scenario, config)`: one group of rollouts of one scenario."""
SingleRolloutFn = Callable[[Any, ScenarioT, ConfigT], Awaitable[Trajectory]]
"""One rollout; `make_group_rollout_fn` runs it n times as a group."""
EvalItems = Sequence[Union[Trajectory, TrajectoryGroup]]
EvalFn = Callable[[Any, int, ConfigT], Awaitable[Union[EvalItems, Mapping[str, EvalItems]]]]
"""`eval_fn(model, step, config)`: trajectories (logged as "val") or {split: trajectories}."""
