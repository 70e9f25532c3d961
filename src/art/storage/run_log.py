"""Writes what `model.log` records: a history row and the step's trajectories."""

from __future__ import annotations

import time

from art.storage.history import append_history, append_jsonl
from art.storage.layout import ModelDir


def write_log(model_dir: ModelDir, *, split: str, step: int, metrics: dict, groups=()) -> None:
    rows = []
    for index, group in enumerate(groups):
        for trajectory in group.trajectories:
            row = trajectory.for_logging()
            row["group"] = index
            rows.append(row)
    if rows:  # trajectories first: a history row never points at missing trajectories
        append_jsonl(model_dir.trajectories(split, step), rows)
    append_history(model_dir.history, {"step": step, "split": split, "recorded_at": time.time(), **metrics})
