"""ART's metric taxonomy: which history keys keep their name, which get the split prefix, and
what a history row derives from what it holds (cost roll-ups, running totals, throughput).

A key whose first section is one of `SECTIONS` (`reward/…`, `loss/…`, `costs/…`, `time/…`, …)
means the same on every split and is written as given; any other key is the split's own and
gets its prefix (`custom` and `checkpoint/foo` logged on "train" become `train/custom` and
`train/checkpoint/foo`). A key that already starts with the split is left alone.

Running totals (`*/cum/*`) are kept where history is written (`CumulativeTotals`, saved beside
`history.jsonl`), so they survive a new `Model` object, a restart and a remote client alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from art.numeric import is_number

SECTIONS = (
    "reward",
    "loss",
    "objective",
    "sample_efficiency",
    "offpolicy",
    "throughput",
    "costs",
    "time",
    "data",
    "discarded",
    "pipeline_settings",
    "task",
    "vllm",
    "sft",
)
"""ART's top-level sections, in the order its W&B charts are declared."""

TRAINING_STEP_KEY = "training_step"
TRAIN_GRADIENT_STEPS_KEY = "data/step_num_gradient_steps"
SFT_METRIC_PREFIX = "sft"
SFT_GRADIENT_STEP_KEY = "gradient_step"
SFT_WANDB_GRADIENT_STEP_KEY = f"{SFT_METRIC_PREFIX}/{SFT_GRADIENT_STEP_KEY}"

_INVARIANT_KEYS = frozenset({TRAIN_GRADIENT_STEPS_KEY})
_IDLE_TOTALS = {
    "throughput/step_trainer_idle_s": "throughput/cum/trainer_idle_s",
    "throughput/step_actor_idle_s": "throughput/cum/actor_idle_s",
}


def route_key(key: str, split: str) -> str:
    """The name `key`, logged on `split`, takes in history and W&B."""
    head, slash, _ = key.partition("/")
    if slash and (head in SECTIONS or head == split):
        return key
    return f"{split}/{key}"


def route(metrics: Mapping[str, Any], split: str) -> dict[str, Any]:
    return {route_key(key, split): value for key, value in metrics.items()}


def is_cumulative(key: str) -> bool:
    parts = key.split("/", 2)
    return len(parts) >= 2 and parts[1] == "cum"


def accumulates(key: str) -> bool:
    """Costs, and the per-step `time/step_*` and `data/step_*` counts, get a running total."""
    return not is_cumulative(key) and key.startswith(("costs/", "time/step_", "data/step_"))


def cumulative_key(key: str) -> str:
    """`time/step_actor_s` -> `time/cum/actor_s`; `costs/train/prefill` -> `costs/cum/train/prefill`."""
    section, rest = key.split("/", 1)
    return f"{section}/cum/{rest.removeprefix('step_')}"


def cost_rollups(metrics: Mapping[str, float]) -> dict[str, float]:
    """Each parent of a cost leaf gets the sum of the leaves under it; `costs/all` sums them all.

    Leaves are the `costs/…` keys that no other key nests under, so roll-ups handed in again
    (a flushed builder's output logged as is) are recomputed, never added twice."""
    costs = [k for k in metrics if k.startswith("costs/") and k != "costs/all" and not is_cumulative(k)]
    leaves = [k for k in costs if not any(other.startswith(f"{k}/") for other in costs)]
    if not leaves:
        return {}
    out: dict[str, float] = {}
    for leaf in leaves:
        parts = leaf.split("/")
        for depth in range(2, len(parts)):
            parent = "/".join(parts[:depth])
            out[parent] = out.get(parent, 0.0) + float(metrics[leaf])
    out["costs/all"] = sum(float(metrics[leaf]) for leaf in leaves)
    return out


def average_metric_samples(samples: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each key over the samples that have it (`data/step_num_gradient_steps`, the
    same in every sample of a step, is kept as is and must agree)."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for sample in samples:
        for key, value in sample.items():
            value = float(value)
            if key in _INVARIANT_KEYS and key in totals and totals[key] != value:
                raise ValueError(f"metric {key!r} must be the same in every sample, got {totals[key]} and {value}")
            if key in _INVARIANT_KEYS:
                totals[key], counts[key] = value, 1
            else:
                totals[key] = totals.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
    return {key: totals[key] / counts[key] for key in totals}


class CumulativeTotals:
    """The running totals of one run: each accumulating key's sum so far and the scenario ids
    seen, as `state_dict()` (JSON) to save beside the history."""

    def __init__(self, state: Mapping[str, Any] | None = None) -> None:
        state = state or {}
        self.totals: dict[str, float] = {str(k): float(v) for k, v in (state.get("cum_state") or {}).items()}
        self.scenario_ids: set[str] = {str(s) for s in state.get("unique_scenario_ids") or []}

    def state_dict(self) -> dict[str, Any]:
        return {"cum_state": dict(self.totals), "unique_scenario_ids": sorted(self.scenario_ids)}

    def derive(self, metrics: Mapping[str, Any], scenario_ids: Iterable[str] = ()) -> dict[str, float]:
        """What a row holding `metrics` adds: cost roll-ups, the running totals of what accumulates,
        the count of unique scenarios (when ids came with it) and average throughput. Updates
        the totals."""
        numbers = {k: float(v) for k, v in metrics.items() if is_number(v)}
        out = cost_rollups(numbers)
        for key, value in {**numbers, **out}.items():
            if accumulates(key):
                total = cumulative_key(key)
                out[total] = self.totals[total] = self.totals.get(total, 0.0) + value
        for key, total in _IDLE_TOTALS.items():
            if key in numbers:
                out[total] = self.totals[total] = self.totals.get(total, 0.0) + numbers[key]
        new_ids = {str(s) for s in scenario_ids}
        if new_ids:
            self.scenario_ids |= new_ids
            out["data/cum/num_unique_scenarios"] = float(len(self.scenario_ids))
        out.update(self._throughput(numbers))
        return out

    def _throughput(self, row: Mapping[str, float]) -> dict[str, float]:
        out = {}
        if row.keys() & {"data/step_trainer_tokens", "data/step_trainer_assistant_tokens", "time/step_trainer_s"}:
            tokens = self.totals.get("data/cum/trainer_assistant_tokens", self.totals.get("data/cum/trainer_tokens"))
            seconds = self.totals.get("time/cum/trainer_s")
            if tokens is not None and seconds:
                out["throughput/avg_trainer_tok_per_s"] = tokens / seconds
        if row.keys() & {"data/step_actor_tokens", "time/step_actor_s"}:
            tokens, seconds = self.totals.get("data/cum/actor_tokens"), self.totals.get("time/cum/actor_s")
            if tokens is not None and seconds:
                out["throughput/avg_actor_tok_per_s"] = tokens / seconds
        return out


# -- ART's batch summary (`summarize_trajectory_groups`) ----------------------------------


@dataclass(frozen=True)
class TrajectoryBatchSummary:
    num_scenarios: int
    """One per group: a group is one scenario's rollouts."""
    num_trajectories: int
    """Rollouts, the failed ones (the groups' exceptions) included."""
    num_groups_submitted: int
    num_groups_trainable: int
    """Groups of two or more trajectories whose rewards differ: GRPO learns nothing from the rest."""
    scenario_ids: list[str]
    """Each distinct `scenario_id` metadata, in first-seen order (the group's, else a trajectory's)."""


def summarize_trajectory_groups(trajectory_groups: Iterable[Any]) -> TrajectoryBatchSummary:
    """ART's counts of a batch of `TrajectoryGroup`s for a train step's row; `model.log` writes the
    same numbers under the same `data/step_*` names (`art.metrics.data_counts`)."""
    groups = list(trajectory_groups)
    ids = [_scenario_id(group) for group in groups]
    return TrajectoryBatchSummary(
        num_scenarios=len(groups),
        num_trajectories=sum(len(group.trajectories) + len(group.exceptions) for group in groups),
        num_groups_submitted=len(groups),
        num_groups_trainable=sum(1 for group in groups if _trainable(group)),
        scenario_ids=list(dict.fromkeys(i for i in ids if i is not None)),
    )


def build_data_metrics_from_summary(
    summary: TrajectoryBatchSummary, *, include_trainable_groups: bool
) -> dict[str, float]:
    """The summary as ART's `data/step_*` metrics (the trainable count only for a train step)."""
    metrics = {
        "data/step_num_scenarios": float(summary.num_scenarios),
        "data/step_num_trajectories": float(summary.num_trajectories),
        "data/step_num_groups_submitted": float(summary.num_groups_submitted),
    }
    if include_trainable_groups:
        metrics["data/step_num_groups_trainable"] = float(summary.num_groups_trainable)
    return metrics


def _trainable(group: Any) -> bool:
    rewards = [trajectory.reward for trajectory in group.trajectories]
    return len(rewards) > 1 and len(set(rewards)) > 1


def _scenario_id(group: Any) -> str | None:
    for metadata in (group.metadata, *(trajectory.metadata for trajectory in group.trajectories)):
        value = metadata.get("scenario_id") if isinstance(metadata, Mapping) else None
        if value is not None:
            return str(value)
    return None
