"""Whether a rollout worker may start a scenario now: the pipeline's admission gate, as arithmetic on
plain numbers (the trainer passes in its counts, `PipelineTrainer._gate`).

A group sampled now could still train in time only while the groups out (running or waiting to
train) fill fewer places than the steps that may take it have, and fewer than `queue_maxsize`
finished groups wait. A group sampled by policy p may train at steps up to p + the age bound (and
never past the run's last step), each of at most `max_batch_size` groups, from the step being
formed on. Starting more would only sample groups bound to be dropped, and on a shared device would
take the trainer's time to do it. A running group counts as the share of groups that have had
signal so far (`signal_share`): one that ends without signal is set aside, and had nothing started
in its place, the step would wait a whole rollout for its replacement. With a bound of 0 and
stale groups waited for: exactly one batch at a time, the synchronous loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_GROUPS, PRIOR_WITH_SIGNAL = 4, 3
"""Before groups finish, the gate assumes it has seen PRIOR_GROUPS of which PRIOR_WITH_SIGNAL had
signal: a running group counts 3/4, so a spare one runs per batch from the start. Measured
(benchmarks/pipeline_vs_sync.py, 60 s reward latency): with exactly one batch out, one group
ending without signal kept the trainer idle a whole rollout (~80 s of a ~75 s step)."""


def signal_share(with_signal: int, without_signal: int) -> float:
    """The share of finished groups that had signal, counting the prior groups too."""
    return (with_signal + PRIOR_WITH_SIGNAL) / (with_signal + without_signal + PRIOR_GROUPS)


@dataclass(frozen=True)
class Gate:
    """The trainer's numbers the gate decides on, at one moment."""

    next_step: int
    """The step being formed: the first a group started now could train at."""
    max_batch_size: int
    """Groups a step trains at most: the places of one step."""
    age_bound: int | None
    """The most steps a group may lag the step training it (the hard bound, else the mean limit
    rounded up); None: unbounded."""
    last_step: int | None
    """The last step this call trains (`max_steps`); None: no end."""
    queue_maxsize: int
    """Finished groups that may wait for a batch."""
    wait_for_stale: bool
    """stale_groups="wait": an old group is waited for and trained, never dropped."""

    def last_step_for(self, version: int) -> int | None:
        """The last step a group sampled by policy `version` may train at (None: no bound)."""
        if self.age_bound is None:
            return self.last_step
        deadline = version + self.age_bound
        return deadline if self.last_step is None else min(deadline, self.last_step)

    def places_until(self, last_step: int | None) -> float:
        """The places in the steps from the one being formed up to `last_step` (None: unbounded)."""
        if last_step is None:
            return math.inf
        return max(0, last_step - self.next_step + 1) * self.max_batch_size

    def places_filled(self, ready: list[int], running: list[int], share: float) -> float:
        """How many places the groups out will fill, oldest first, each in a step it is young
        enough for; `ready` and `running` are their policy versions. A group too old for every
        place left fills none: it will be dropped, and counting it (a spare sampled a step ago,
        say) would leave the next step short. When stale groups are waited for every group counts
        in full and no spare runs: a group started beyond the batch would have to train in it,
        and the batch size is the user's."""
        if self.wait_for_stale:
            return float(len(ready) + len(running))
        out = sorted([(version, 1.0) for version in ready] + [(version, share) for version in running])
        filled = 0.0
        for version, weight in out:  # deadlines rise with the version: earliest deadline first
            filled = min(filled + weight, self.places_until(self.last_step_for(version)))
        return filled

    def may_start(self, policy: int, ready: list[int], running: list[int], share: float) -> bool:
        """Whether a group sampled now by policy `policy` could still train in time."""
        if len(ready) >= self.queue_maxsize:
            return False
        last = self.last_step_for(policy)
        if last is None:
            return True
        return self.places_filled(ready, running, share) < self.places_until(last) - 1e-9
