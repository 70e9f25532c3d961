"""Every logged trajectory of a project, one row each (ART's `load_trajectories`).

A row has ART's columns: `model`, `split`, `step`, `reward`, `group_number` (a running count
of groups, to tell groups apart), `messages` (each with `trainable`: True for the model's own
Choices), `logs`, one `metric_{key}` column per trajectory metric and one `metadata_{key}`
(as a string) per metadata key, the group's metadata under the trajectory's. The rows come
from the run folders `{art_path}/{project}/models/{model}/trajectories/{split}/{step}.jsonl`
(or `.parquet`, read with `art.utils.trajectory_logging`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from art.errors import ArtError
from art.utils.output_dirs import get_models_dir

TRAJECTORY_SUFFIXES = (".jsonl", ".parquet")


def trajectory_rows(
    project_name: str, models: list[str] | None = None, debug: bool = False, art_path: str | None = None
) -> list[dict[str, Any]]:
    """The rows as dicts, without polars: `load_trajectories`' table, and what the charts draw.
    Every row has every column (None where a trajectory lacks a metric or metadata key)."""
    root = Path(get_models_dir(project_name, art_path))
    wanted = set(models) if models is not None else None
    rows: list[dict[str, Any]] = []
    group_number = 0
    model_dirs = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    for model_dir in model_dirs:
        if wanted is not None and model_dir.name not in wanted:
            continue
        for split_dir in sorted(p for p in (model_dir / "trajectories").glob("*") if p.is_dir()):
            for path in _step_files(split_dir):
                if debug:
                    print(f"load_trajectories: {path}")
                for group_metadata, trajectories in _groups(path):
                    group_number += 1
                    for trajectory in trajectories:
                        rows.append(
                            _row(
                                model_dir.name, split_dir.name, int(path.stem), group_number, group_metadata, trajectory
                            )
                        )
    columns = {key: None for row in rows for key in row}
    return [{**columns, **row} for row in rows]


def _step_files(split_dir: Path) -> list[Path]:
    """One file per step: the JSONL our run log writes (always whole), else ART's Parquet. With
    pyarrow installed a step has both, holding the same trajectories."""
    steps: dict[str, Path] = {}
    for path in sorted(split_dir.iterdir()):
        if path.suffix not in TRAJECTORY_SUFFIXES or not path.stem.isdigit():
            continue  # NNNN.exceptions.jsonl, NNNN.trainer_logprobs.jsonl, temp files
        if path.stem not in steps or path.suffix == ".jsonl":
            steps[path.stem] = path
    return [steps[stem] for stem in sorted(steps)]


async def load_trajectories(
    project_name: str, models: list[str] | None = None, debug: bool = False, art_path: str | None = None
):
    """A polars DataFrame of `trajectory_rows`, as ART's returns (polars is not a dependency of
    this library: install it, or use `trajectory_rows` for the same rows as dicts; the charts
    take either)."""
    try:
        import polars as pl
    except ImportError as exc:
        raise ArtError(
            "load_trajectories returns a polars DataFrame, as ART's does: `pip install polars`, "
            "or call art.utils.benchmarking.trajectory_rows for the same rows as dicts"
        ) from exc
    rows = trajectory_rows(project_name, models, debug, art_path)
    for row in rows:  # ART's message struct: role, content (text), tool calls' names and arguments
        row["messages"] = [_message_struct(m) for m in row["messages"]]
    message = pl.Struct(
        {
            "role": pl.Utf8,
            "content": pl.Utf8,
            "trainable": pl.Boolean,
            "tool_calls": pl.List(pl.Struct({"function": pl.Struct({"name": pl.Utf8, "arguments": pl.Utf8})})),
        }
    )
    schema: dict[str, Any] = {
        "model": pl.Utf8,
        "split": pl.Utf8,
        "step": pl.Int64,
        "reward": pl.Float64,
        "group_number": pl.Int64,
        "messages": pl.List(message),
        "logs": pl.List(pl.Utf8),
    }
    for key in rows[0] if rows else {}:
        if key.startswith("metric_"):
            schema[key] = pl.Float64
        elif key.startswith("metadata_"):
            schema[key] = pl.Utf8
    return pl.DataFrame(rows, schema=schema)


def _groups(path: Path) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(group metadata, trajectory dicts as `Trajectory.for_logging` writes them) per group."""
    if path.suffix == ".parquet":
        from art.utils.trajectory_logging import read_trajectory_groups_parquet

        for group in read_trajectory_groups_parquet(path):
            yield dict(group.metadata), [t.for_logging() for t in group.trajectories]
        return
    groups: dict[int, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            groups.setdefault(int(record.pop("group", 0)), []).append(record)
    for index in sorted(groups):
        yield {}, groups[index]


def _row(
    model: str, split: str, step: int, group_number: int, group_metadata: dict[str, Any], trajectory: dict[str, Any]
) -> dict[str, Any]:
    messages = []
    for item in trajectory.get("messages_and_choices") or []:
        if isinstance(item, dict) and "message" in item and "role" not in item:  # a dumped Choice
            messages.append({**item["message"], "trainable": True})
        else:
            messages.append({**item, "trainable": False})
    metadata = {**group_metadata, **(trajectory.get("metadata") or {})}
    return {
        "model": model,
        "split": split,
        "step": step,
        "reward": trajectory.get("reward"),
        "group_number": group_number,
        "messages": messages,
        "logs": trajectory.get("logs"),
        **{f"metric_{k}": (float(v) if v is not None else None) for k, v in (trajectory.get("metrics") or {}).items()},
        **{f"metadata_{k}": str(v) for k, v in metadata.items()},
    }


def _message_struct(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    calls = [
        {
            "function": {
                "name": (c.get("function") or {}).get("name"),
                "arguments": (c.get("function") or {}).get("arguments"),
            }
        }
        for c in message.get("tool_calls") or []
    ]
    return {
        "role": message.get("role"),
        "trainable": bool(message.get("trainable")),
        "tool_calls": calls or None,
        "content": content if content is None or isinstance(content, str) else json.dumps(content),
    }
