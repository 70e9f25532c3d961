"""What the dashboard reads from run folders: the run list, history rows, logged steps.

Listing runs must stay cheap however long they trained: each run costs a stat of its history
file, a listing of its checkpoints folder and a read of the history's last few KiB, never a
read of its trajectory files. History is read from a byte offset (`since`), so a page that
polls every few seconds reads only what was appended since its last poll.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path

from art.numeric import is_finite
from art.storage import step_files
from art.storage.layout import ModelDir, validate_name

TRAINING_WINDOW_S = 60.0
"""A run is "training" while a checkpoint is being written (a `.tmp-NNNN-*` folder beside the
checkpoints) or its history was appended to within this many seconds; otherwise "idle". A step
that runs longer than this between two log rows shows "idle" until its checkpoint is written."""
TAIL_BYTES = 64 * 1024
"""How much of a history file's end the run list reads to find the last reward."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_STEP = re.compile(r"^\d{4,}$")
_WRITING = re.compile(r"^\.tmp-\d{4,}-")


def run_dir(root: Path, project: str, name: str) -> ModelDir:
    """The run's folder; ArtValueError (400, naming `project` or `name`) for a name that could
    leave the root; ModelNotFoundError (404) when there is no such run."""
    from art.errors import ModelNotFoundError

    directory = ModelDir(root, validate_name(project, "project"), validate_name(name, "name"))
    if not (directory.model_json.is_file() or directory.history.is_file()):
        raise ModelNotFoundError(f"no run {project}/{name} under {root}")
    return directory


def list_runs(root: Path, *, now: float | None = None) -> list[dict]:
    """Every run under `root` (a trainable model's `model.json`, or a history of a model logged
    from elsewhere), sorted by project and name, with its latest checkpoint, last reward and status."""
    now = time.time() if now is None else now
    runs = []
    for folder in sorted(Path(root).glob("*/models/*")):
        project, name = folder.parts[-3], folder.parts[-1]
        if not (_NAME.match(project) and _NAME.match(name) and ".." not in project + name):
            continue
        directory = ModelDir(root, project, name)
        if not (directory.model_json.is_file() or directory.history.is_file()):
            continue
        runs.append(summarize(directory, project, name, now))
    return runs


def summarize(directory: ModelDir, project: str, name: str, now: float) -> dict:
    model = directory.read_model_json() or {}
    steps, writing = _checkpoints(directory.checkpoints)
    try:
        modified = directory.history.stat().st_mtime
    except OSError:
        modified = None
    last = last_rows(directory.history) if modified is not None else []
    reward_row = next((row for row in reversed(last) if _number(row.get("train/reward")) is not None), None)
    recent = modified is not None and now - modified < TRAINING_WINDOW_S
    return {
        "project": project,
        "name": name,
        "base_model": model.get("base_model"),
        "trainable": directory.model_json.is_file(),
        "step": steps[-1] if steps else None,
        "last_logged_step": last[-1].get("step") if last else None,
        "reward": _number(reward_row.get("train/reward")) if reward_row else None,
        "reward_step": reward_row.get("step") if reward_row else None,
        "status": "training" if writing or recent else "idle",
        "updated_at": modified,
    }


def _checkpoints(folder: Path) -> tuple[list[int], bool]:
    """The saved steps, and whether a checkpoint is being written right now."""
    steps, writing = [], False
    try:
        entries = list(folder.iterdir())
    except OSError:
        return [], False
    for entry in entries:
        if _STEP.match(entry.name):
            steps.append(int(entry.name))
        elif _WRITING.match(entry.name):
            writing = True
    return sorted(steps), writing


def last_rows(path: Path, tail_bytes: int = TAIL_BYTES) -> list[dict]:
    """The complete rows in the last `tail_bytes` of a history file (the first line of the tail
    is dropped: it may be cut)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            start = max(0, size - tail_bytes)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]
    return [row for row in map(_parse, lines[:-1]) if row is not None]  # the last piece is unfinished


def read_history(path: Path, since: int = 0) -> dict:
    """Rows appended from byte offset `since` on. `next` is the offset to ask for next time: it
    stops after the last complete line, so a row being written is returned whole on a later
    poll. `reset` is true when `since` lies past the end (the file was replaced): then every row
    is returned and the caller starts over."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            reset = since > size
            start = 0 if reset else since
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return {"rows": [], "next": 0, "reset": since > 0}
    end = data.rfind(b"\n") + 1
    rows = [row for row in map(_parse, data[:end].split(b"\n")) if row is not None]
    return {"rows": rows, "next": start + end, "reset": reset}


def logged_steps(directory: ModelDir) -> dict[str, list[int]]:
    """{split: [steps]} that have a trajectories file (ours or ART's, JSONL or Parquet), from a
    folder listing."""
    out: dict[str, list[int]] = {}
    base = directory.path / "trajectories"
    try:
        splits = [p for p in base.iterdir() if p.is_dir() and _NAME.match(p.name)]
    except OSError:
        return out
    for split in sorted(splits, key=lambda p: p.name):
        steps = step_files.logged_steps(split)
        if steps:
            out[split.name] = steps
    return out


def loads(text: str | bytes):
    """json.loads with NaN and Infinity (which Python's json writes) read as None: the answer
    must be strict JSON for the browser."""
    return json.loads(text, parse_constant=lambda _: None)


def _parse(line: bytes) -> dict | None:
    line = line.strip()
    if not line:
        return None
    try:
        row = loads(line)
    except ValueError:
        return None  # a line cut short by a crash
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("recorded_at"), str):  # ART writes an ISO time (local); the chart's time axis wants seconds
        row["recorded_at"] = _epoch(row["recorded_at"])
    return row


def _epoch(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _number(value) -> float | None:
    if not is_finite(value):
        return None
    return float(value)
