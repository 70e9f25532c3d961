"""Summary metrics of logged trajectories (ART's names), computed on the client side."""

from __future__ import annotations

import math
from collections import defaultdict


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(groups) -> dict[str, float]:
    """reward, reward_std_dev (mean within-group std), exception_rate, every trajectory metric
    averaged, group metrics as `group_<key>`, and counts."""
    rewards: list[float] = []
    stds: list[float] = []
    per_metric: dict[str, list[float]] = defaultdict(list)
    exceptions = 0
    trajectories = 0
    for group in groups:
        group_rewards = [float(t.reward) for t in group.trajectories]
        rewards += group_rewards
        trajectories += len(group_rewards)
        exceptions += len(getattr(group, "exceptions", None) or [])
        if group_rewards:
            mean = _mean(group_rewards)
            stds.append(math.sqrt(_mean([(r - mean) ** 2 for r in group_rewards])))
        for t in group.trajectories:
            for key, value in (t.metrics or {}).items():
                if isinstance(value, (int, float)):
                    per_metric[key].append(float(value))
        for key, value in (getattr(group, "metrics", None) or {}).items():
            if isinstance(value, (int, float)):
                per_metric[f"group_{key}"].append(float(value))
    out = {
        "reward": _mean(rewards),
        "reward_std_dev": _mean(stds),
        "exception_rate": exceptions / (exceptions + trajectories) if exceptions + trajectories else 0.0,
        "num_groups": float(len(stds)),
        "num_trajectories": float(trajectories),
    }
    out.update({key: _mean(values) for key, values in per_metric.items()})
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}
