"""A logged step's trajectories, whichever of the three layouts holds them.

A step's samples live in `trajectories/{split}/{step:04d}.*`:
- our run log: `.jsonl`, one `Trajectory.for_logging()` dict per line with its `group` index
  (the record: token ids and logprobs), failed groups beside it in `.exceptions.jsonl`;
- ART's earlier runs: `.jsonl`, one group per line (`{"trajectories": [...]}`);
- ART's current runs, or a folder after `art.utils.trajectory_migration`: `.parquet` only.

Readers (the dashboard, the migration) ask here, so an ART run folder opens like one of ours.
The JSONL is read first when both exist: ours is the record and the Parquet its copy.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art.storage import trajectory_parquet
from art.storage.layout import ModelDir

SIDECAR_SUFFIXES = (".exceptions.jsonl", ".trainer_logprobs.jsonl")
"""Files beside a step's trajectories that are not trajectories."""
_STEP_FILE = re.compile(r"^(\d{4,})\.(jsonl|parquet)$")


@dataclass
class StepRows:
    """One step's trajectories as plain dicts (`Trajectory.for_logging()` shape, each with its
    `group` index) and its failed groups ({group, exceptions})."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    source: Path | None = None
    """The file they were read from."""


def is_sidecar(path: Path) -> bool:
    return path.name.endswith(SIDECAR_SUFFIXES)


def logged_steps(split_dir: Path) -> list[int]:
    """The steps that have a trajectories file (JSONL or Parquet) in a split's folder."""
    try:
        names = [entry.name for entry in split_dir.iterdir()]
    except OSError:
        return []
    return sorted({int(match.group(1)) for match in map(_STEP_FILE.match, names) if match})


def read_step_rows(directory: ModelDir, split: str, step: int) -> StepRows | None:
    """The step's trajectories and failures, or None when it logged neither."""
    jsonl = directory.trajectories(split, step)
    sidecar = jsonl.with_name(f"{jsonl.stem}.exceptions.jsonl")
    lines = _lines(jsonl)
    if lines is not None:
        entries = [_load(line) for line in lines]
        if entries and all(isinstance(e, dict) and "trajectories" in e for e in entries):
            return _from_art_groups(entries, jsonl)
        return StepRows(
            rows=[e if isinstance(e, dict) else {} for e in entries],
            failed=[e for e in map(_load, _lines(sidecar) or []) if isinstance(e, dict)],
            source=jsonl,
        )
    parquet = jsonl.with_suffix(".parquet")
    if parquet.exists():
        return _from_parquet(parquet)
    failed = _lines(sidecar)
    if failed is not None:
        return StepRows(failed=[e for e in map(_load, failed) if isinstance(e, dict)], source=sidecar)
    return None


def _from_art_groups(entries: list[dict], path: Path) -> StepRows:
    out = StepRows(source=path)
    for index, entry in enumerate(entries):
        for trajectory in entry.get("trajectories") or []:
            if isinstance(trajectory, dict):
                out.rows.append({**trajectory, "group": index})
        if entry.get("exceptions"):
            out.failed.append({"group": index, "exceptions": list(entry["exceptions"])})
    return out


def _from_parquet(path: Path) -> StepRows:
    out = StepRows(source=path)
    for index, group in enumerate(trajectory_parquet.read_groups(path)):
        out.rows.extend({**trajectory.for_logging(), "group": index} for trajectory in group.trajectories)
        if group.exceptions:
            out.failed.append({"group": index, "exceptions": [e.model_dump(mode="json") for e in group.exceptions]})
    return out


def _lines(path: Path) -> list[str] | None:
    """The file's non-empty lines; None when the file does not exist. A last line without its
    newline is kept only when it is whole JSON: ART ends its files so, while one of ours being
    appended to may be cut mid-line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and not text.endswith("\n") and _load(lines[-1]) is None:
        lines.pop()
    return lines


def _load(line: str) -> Any:
    try:
        return json.loads(line, parse_constant=lambda _: None)
    except ValueError:
        return None
