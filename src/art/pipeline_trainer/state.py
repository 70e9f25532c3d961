"""What a pipeline remembers across a kill: which scenarios are used up, and its counters.

Saved in the run's `state.json` (`Model.merge_state`, under ART's key `_pipeline_trainer`)
after every step and evaluation. A scenario is used up once its group was trained, dropped or
failed; one still running or waiting for a batch when the process dies is not, so a resumed
pipeline runs it again: nothing is skipped untrained.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

STATE_KEY = "_pipeline_trainer"


@dataclass
class PipelineState:
    scenario_offset: int = 0
    """Every scenario before this index is used up (ART's name)."""
    used_after_offset: list[int] = field(default_factory=list)
    """Used-up scenarios past the offset (they finished before older ones)."""
    total_scenarios_consumed: int = 0
    training_step: int = 0
    last_eval_step: int = 0
    completed_eval_steps: list[int] = field(default_factory=list)
    accepted_trainable_groups: int = 0
    discarded_stale_groups: int = 0
    discarded_zero_variance_groups: int = 0
    failed_rollouts: int = 0

    @classmethod
    def from_saved(cls, saved: dict | None) -> PipelineState:
        """The saved state (unknown or mistyped keys ignored), or a new one."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in (saved or {}).items():
            if key in known and isinstance(
                value, list if key in ("used_after_offset", "completed_eval_steps") else int
            ):
                values[key] = value
        return cls(**values)

    def use_up(self, index: int) -> None:
        """Scenario `index` is trained, dropped or failed: a resumed pipeline skips it."""
        used = set(self.used_after_offset) | {index}
        while self.scenario_offset in used:
            used.discard(self.scenario_offset)
            self.scenario_offset += 1
        self.used_after_offset = sorted(i for i in used if i > self.scenario_offset)

    def is_used(self, index: int) -> bool:
        return index < self.scenario_offset or index in self.used_after_offset

    def saved(self) -> dict:
        return asdict(self)
