"""The progress of one gather: how many rollouts it expects and has seen end, their mean reward
and metrics, the completion tokens they sampled, all drawn on a progress bar, and the limit on
failed rollouts that stops the gather.

Kept apart from `art.gather`, which runs the groups: this is what their rollouts report to (the
`art.rollout_runs.RolloutReporter` that `art.gather` sets) and what the bar shows.
"""

from __future__ import annotations

import math
from typing import Any

from art.numeric import is_number

from .errors import ArtValueError, TooManyExceptionsError
from .observability.progress import progress_bar
from .trajectories import Trajectory, TrajectoryGroup, completion_tokens


def _check_max_exceptions(max_exceptions: int | float, name: str = "max_exceptions") -> None:
    """Refuse an exception limit that is neither a count nor a fraction, naming the argument."""
    number = is_number(max_exceptions)
    if not number or not max_exceptions >= 0:
        raise ArtValueError(
            f"{name} must be a count (int >= 0) or a fraction in (0, 1), got {max_exceptions!r}", field=name
        )


class GatherProgress:
    """Counts what finishes under one gather call and draws it on a tqdm bar; the
    `art.rollout_runs.RolloutReporter` its rollouts report to, and what enforces `max_exceptions`."""

    def __init__(
        self,
        desc: str | None,
        max_exceptions: int | float,
        max_metrics: int | None,
        show_tokens: bool,
        limit_name: str = "max_exceptions",
    ) -> None:
        _check_max_exceptions(max_exceptions, limit_name)
        self.limit_name = limit_name
        self.max_exceptions = max_exceptions
        self.max_metrics = max_metrics
        self.show_tokens = show_tokens
        self.total = 0
        self.exceptions = 0
        self.first_exception: BaseException | None = None
        self.reward_sum, self.rewards, self.finished = 0.0, 0, 0
        self.metric_sums: dict[str, float] = {}
        self.metric_counts: dict[str, int] = {}
        self.tokens = 0
        self._expected: dict[int, object] = {}  # id -> object, kept alive so ids stay unique
        self._recorded: dict[int, tuple[object, float, dict[str, float]]] = {}
        """id -> (trajectory, its reward and metrics as counted): what `rescore` takes back out."""
        self.notes: dict[str, int] = {}
        self.pbar = progress_bar(total=0, desc=desc, disable=desc is None, unit="traj")

    def limit(self) -> float:
        """How many exceptions are tolerated: a count, or a fraction of all trajectories."""
        if isinstance(self.max_exceptions, float) and 0 < self.max_exceptions < 1:
            return math.floor(self.max_exceptions * self.total + 1e-9)
        return self.max_exceptions

    def expect(self, key: object, n: int) -> None:
        if id(key) not in self._expected:
            self._expected[id(key)] = key
            self.total += n
            self.pbar.total = self.total
            self.pbar.refresh()

    def record_trajectory(self, trajectory: Trajectory) -> None:
        if id(trajectory) in self._recorded:
            return
        self._add(trajectory)
        self.finished += 1
        if self.show_tokens:
            self.tokens += completion_tokens(trajectory)
        self._advance()

    def rescore(self, before: TrajectoryGroup, after: TrajectoryGroup) -> None:
        """Show the rewards and metrics `after_each` gave a group (RULER's scores) in place of
        those its rollouts finished with: they are what trains. Rollout counts do not change."""
        for trajectory in before.trajectories:
            self._remove(trajectory)
        for trajectory in after.trajectories:
            self._remove(trajectory)  # (one changed in place is counted with its new values)
            self._add(trajectory)
        self._show()

    def _add(self, trajectory: Trajectory) -> None:
        # The bar must never fail a gather: skip metric values that are not finite numbers.
        metrics = {
            key: float(value)
            for key, value in trajectory.metrics.items()
            if isinstance(value, (int, float)) and math.isfinite(value)
        }
        self._recorded[id(trajectory)] = (trajectory, trajectory.reward, metrics)
        self.reward_sum += trajectory.reward
        self.rewards += 1
        for key, value in metrics.items():
            self.metric_sums[key] = self.metric_sums.get(key, 0.0) + value
            self.metric_counts[key] = self.metric_counts.get(key, 0) + 1

    def _remove(self, trajectory: Trajectory) -> None:
        entry = self._recorded.pop(id(trajectory), None)
        if entry is None:
            return
        _, reward, metrics = entry
        self.reward_sum -= reward
        self.rewards -= 1
        for key, value in metrics.items():
            self.metric_counts[key] -= 1
            if self.metric_counts[key]:
                self.metric_sums[key] -= value
            else:
                del self.metric_counts[key], self.metric_sums[key]

    def record_exception(self, exception: BaseException) -> None:
        self.exceptions += 1
        if self.first_exception is None:
            self.first_exception = exception
        self._advance()
        limit = self.limit()
        if self.exceptions > limit:
            first = self.first_exception
            raise TooManyExceptionsError(
                f"{self.exceptions} of {self.total} rollouts raised, more than {self.limit_name}="
                f"{self.max_exceptions!r} allows (limit {limit}); the first was "
                f"{type(first).__name__}: {str(first).rstrip('.')}. Raise {self.limit_name} to drop failed "
                "rollouts instead."
            ) from first

    def account(self, group: TrajectoryGroup) -> None:
        """Count a finished group's trajectories that were not seen finishing (already done ones)."""
        self.expect(group, len(group.trajectories))
        for trajectory in group.trajectories:
            self.record_trajectory(trajectory)

    def _advance(self) -> None:
        self._show()
        self.pbar.update(1)

    def _show(self) -> None:
        postfix: dict[str, Any] = {}
        if self.rewards:
            postfix["reward"] = self.reward_sum / self.rewards
        keys = list(self.metric_sums)[: self.max_metrics]
        postfix.update({key: self.metric_sums[key] / self.metric_counts[key] for key in keys})
        if self.exceptions:
            postfix["exceptions"] = self.exceptions
        postfix.update(self.notes)
        if self.show_tokens and self.tokens:
            postfix["completion_tokens"] = self.tokens
        self.pbar.set_postfix(postfix, refresh=False)

    def reset(self, total: int) -> None:
        """Start counting anew (a new batch of `trajectory_group_batches`), `total` trajectories expected."""
        self.pbar.close()
        self.total, self.exceptions, self.first_exception = total, 0, None
        self.reward_sum, self.rewards, self.finished, self.tokens = 0.0, 0, 0, 0
        self.metric_sums, self.metric_counts, self.notes = {}, {}, {}
        self.pbar = progress_bar(
            total=total, desc=self.pbar.desc if not self.pbar.disable else None, disable=self.pbar.disable, unit="traj"
        )

    def reward_mean(self) -> float | None:
        """Over every finished rollout, with the reward `after_each` gave it where it did."""
        return self.reward_sum / self.rewards if self.rewards else None

    def note(self, key: str, value: int) -> None:
        """A count shown after the metrics (e.g. groups dropped by dynamic sampling)."""
        self.notes[key] = value

    def close(self) -> None:
        self.pbar.close()
