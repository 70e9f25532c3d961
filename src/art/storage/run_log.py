"""Writes what `model.log` records: a history row and the step's trajectories."""

from __future__ import annotations

import json
import time
from pathlib import Path

from art.errors import ArtValueError
from art.naming import MAX_METRIC_NAME, MAX_STEP, echo
from art.storage.history import append_history, append_jsonl
from art.storage.layout import ModelDir, write_atomic

ROW_KEYS = ("step", "split", "recorded_at")
"""What every history row carries itself; a metric may not take these names."""


def check_log(step: int, metrics: dict) -> None:
    """Refuse, before anything is written, a step outside [0, MAX_STEP] and metric names that would
    overwrite the row's own keys or are not short strings."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ArtValueError(f"step must be an int in [0, {MAX_STEP}], got {echo(step)}", field="step")
    for key in metrics:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_METRIC_NAME:
            raise ArtValueError(f"metric names must be strings of 1-{MAX_METRIC_NAME} characters, got {echo(key)}",
                                field="metrics")
        if key in ROW_KEYS:
            raise ArtValueError(f"metric {echo(key)} would overwrite the history row's own {key!r}; rename it "
                                f"(the row keys are {', '.join(ROW_KEYS)})", field=f"metrics.{key}")


def exceptions_file(model_dir: ModelDir, split: str, step: int) -> Path:
    """`trajectories/{split}/{step:04d}.exceptions.jsonl`: one line per group whose rollouts raised."""
    path = model_dir.trajectories(split, step)
    return path.with_name(f"{path.stem}.exceptions.jsonl")


def trainer_logprobs_file(model_dir: ModelDir, step: int) -> Path:
    """`trajectories/train/{step:04d}.trainer_logprobs.jsonl`: the trainer's logprob of every
    trained token of the step that trained on that step's trajectories, one line per sequence
    ({group, trajectory (its index in the group), sequence, logprobs}); the dashboard's token
    view sets them beside the sampler's."""
    path = model_dir.trajectories("train", step)
    return path.with_name(f"{path.stem}.trainer_logprobs.jsonl")


def write_trainer_logprobs(model_dir: ModelDir, step: int, rows: list[dict]) -> None:
    """Replace the step's file (a step trained again after a rollback writes it anew)."""
    path = trainer_logprobs_file(model_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))


def write_log(model_dir: ModelDir, *, split: str, step: int, metrics: dict, groups=()) -> None:
    check_log(step, metrics)
    rows = []
    for index, group in enumerate(groups):
        for trajectory in group.trajectories:
            row = trajectory.for_logging()
            row["group"] = index
            rows.append(row)
    failed = [{"group": index, "exceptions": [e.model_dump(mode="json") for e in group.exceptions]}
              for index, group in enumerate(groups) if getattr(group, "exceptions", None)]
    if rows:  # trajectories first: a history row never points at missing trajectories
        append_jsonl(model_dir.trajectories(split, step), rows)
    if failed:  # beside them, so each line of the trajectories file stays one trajectory
        append_jsonl(exceptions_file(model_dir, split, step), failed)
    append_history(model_dir.history, {"step": step, "split": split, "recorded_at": time.time(), **metrics})
