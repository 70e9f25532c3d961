"""Writes what `model.log` records: a history row and the step's trajectories (JSONL, and a copy
in ART's Parquet layout when pyarrow is installed)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from art.errors import ArtValueError
from art.metrics_taxonomy import TRAINING_STEP_KEY
from art.naming import MAX_METRIC_NAME, MAX_STEP, echo
from art.storage import trajectory_parquet
from art.storage.history import append_jsonl
from art.storage.layout import ModelDir, write_atomic
from art.storage.metric_totals import append_with_totals

log = logging.getLogger(__name__)

ROW_KEYS = ("step", "recorded_at", TRAINING_STEP_KEY)
"""What every history row carries itself, ART's keys; every other key is a metric."""
RESERVED_NAMES = (*ROW_KEYS, "split")
"""Names a metric may not take: the row's own keys, and `split`, which rows written before the
split moved into the metric names carried (`art.storage.history.row_split`)."""


def check_log(step: int, metrics: dict) -> None:
    """Refuse, before anything is written, a step outside [0, MAX_STEP] and metric names that would
    overwrite the row's own keys or are not short strings."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ArtValueError(f"step must be an int in [0, {MAX_STEP}], got {echo(step)}", field="step")
    for key in metrics:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_METRIC_NAME:
            raise ArtValueError(
                f"metric names must be strings of 1-{MAX_METRIC_NAME} characters, got {echo(key)}", field="metrics"
            )
        if key in RESERVED_NAMES:
            raise ArtValueError(
                f"metric {echo(key)} would overwrite the history row's own {key!r}; rename it "
                f"(reserved: {', '.join(RESERVED_NAMES)})",
                field=f"metrics.{key}",
            )


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


def parquet_file(model_dir: ModelDir, split: str, step: int) -> Path:
    """`trajectories/{split}/{step:04d}.parquet`: the step's groups in ART's Parquet layout
    (art.storage.trajectory_parquet), written beside the JSONL when pyarrow is installed, so
    ART's `read_trajectory_groups_parquet` reads our runs."""
    return model_dir.trajectories(split, step).with_suffix(".parquet")


_PARQUET_LOCK = threading.Lock()  # two logs of one step in this process: each rewrite sees the other


def write_parquet_copy(model_dir: ModelDir, split: str, step: int, groups) -> None:
    """Add `groups` to the step's Parquet file (rewritten whole: Parquet does not append). The
    JSONL is the record: a failure here is logged, never raised into a training run."""
    path = parquet_file(model_dir, split, step)
    try:
        with _PARQUET_LOCK:
            earlier = trajectory_parquet.read_groups(path) if path.exists() else []
            trajectory_parquet.write_groups([*earlier, *groups], path)
    except Exception:  # the copy in ART's format is a convenience
        log.warning(
            "could not write %s; the step's trajectories are in %s",
            path,
            model_dir.trajectories(split, step),
            exc_info=True,
        )


def write_trainer_logprobs(model_dir: ModelDir, step: int, rows: list[dict]) -> None:
    """Replace the step's file (a step trained again after a rollback writes it anew)."""
    path = trainer_logprobs_file(model_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))


def write_log(
    model_dir: ModelDir, *, split: str, step: int, metrics: dict, groups=(), scenario_ids: Iterable[str] = ()
) -> dict:
    """Write the step's trajectories, then its history row (with `training_step` and what the run's
    running totals derive from it, art.storage.metric_totals); the row as written. The row holds
    ART's keys only (step, recorded_at, training_step, metrics): its split is in the metric
    names `model.log` gave (`val/reward`), as ART's readers expect."""
    check_log(step, metrics)
    rows = []
    for index, group in enumerate(groups):
        for trajectory in group.trajectories:
            row = trajectory.for_logging()
            row["group"] = index
            rows.append(row)
    failed = [
        {"group": index, "exceptions": [e.model_dump(mode="json") for e in group.exceptions]}
        for index, group in enumerate(groups)
        if getattr(group, "exceptions", None)
    ]
    if rows:  # trajectories first: a history row never points at missing trajectories
        append_jsonl(model_dir.trajectories(split, step), rows)
    if failed:  # beside them, so each line of the trajectories file stays one trajectory
        append_jsonl(exceptions_file(model_dir, split, step), failed)
    if groups and trajectory_parquet.available():
        write_parquet_copy(model_dir, split, step, groups)
    row = {"step": step, "recorded_at": time.time(), TRAINING_STEP_KEY: step, **metrics}
    return append_with_totals(model_dir.history, row, scenario_ids)
