"""Trajectory groups as a Parquet file in OpenPipe ART's layout (its format version 2), and back.

One row per trajectory; a group without trajectories keeps one row with no trajectory, so that
it and its exceptions survive. Each row carries the whole group and the whole trajectory as JSON
(`group_json`, `trajectory_json`: what reading restores, Choices with their token ids and
logprobs) and ART's flat columns beside them for queries (`reward`, `metrics`, `metadata`,
`tools`, `logs`, `messages` as {role, content, tool_calls, tool_call_id, trainable},
`group_metadata`, `group_metrics`, `group_logs`), ZSTD-compressed. A file ART wrote before the
JSON columns existed (no version marker) is read from the flat columns, so its choices come
back as plain assistant messages; the `tools` and `additional_histories` columns ART's JSONL
migration added to that layout are read too.

pyarrow is imported on use (`available()` says whether it is installed): the client installs
without it, and then the run log keeps JSONL only.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion import Choice

from art.errors import ArtValueError
from art.numeric import is_int, is_number
from art.trajectories import History, Trajectory, TrajectoryGroup, is_choice

FORMAT_VERSION = 2
VERSION_KEY = b"art.trajectory_parquet.version"
"""The file-level metadata key ART marks its versioned files with."""


def available() -> bool:
    return importlib.util.find_spec("pyarrow") is not None


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ModuleNotFoundError(
            "Parquet trajectory files need pyarrow (pip install pyarrow); "
            "without it the run log keeps its JSONL files only"
        ) from exc
    return pa, pq


def _schema(pa: Any) -> Any:
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("tool_calls", pa.string()),
            ("tool_call_id", pa.string()),
            ("trainable", pa.bool_()),
        ]
    )
    return pa.schema(
        [
            ("format_version", pa.int16()),
            ("group_index", pa.int64()),
            ("trajectory_index", pa.int64()),
            ("group_json", pa.large_string()),
            ("trajectory_json", pa.large_string()),
            ("group_metadata", pa.string()),
            ("group_metrics", pa.string()),
            ("group_logs", pa.list_(pa.string())),
            ("reward", pa.float64()),
            ("metrics", pa.string()),
            ("metadata", pa.string()),
            ("tools", pa.string()),
            ("logs", pa.list_(pa.string())),
            ("messages", pa.list_(message)),
        ],
        metadata={VERSION_KEY: str(FORMAT_VERSION).encode()},
    )


# -- writing ------------------------------------------------------------------------------


def write_groups(groups: Iterable[TrajectoryGroup], path: str | Path) -> None:
    """Replace `path` with `groups` (atomically: a reader sees the old file or the new one)."""
    pa, pq = _pyarrow()
    rows: list[dict[str, Any]] = []
    for group_index, group in enumerate(groups):
        group_data = group.model_dump(mode="json", exclude={"trajectories"})
        shared = {
            "format_version": FORMAT_VERSION,
            "group_index": group_index,
            "group_json": _json(group_data),
            "group_metadata": _json_or_none(group_data.get("metadata")),
            "group_metrics": _json_or_none(group_data.get("metrics")),
            "group_logs": group_data.get("logs") or None,
        }
        trajectories = [t for t in group.trajectories if isinstance(t, Trajectory)]
        if not trajectories:
            rows.append({**shared, "trajectory_index": None, "trajectory_json": None})
        for trajectory_index, trajectory in enumerate(trajectories):
            data = trajectory.for_logging()
            rows.append(
                {
                    **shared,
                    "trajectory_index": trajectory_index,
                    "trajectory_json": _json(data),
                    "reward": trajectory.reward,
                    "metrics": _json_or_none(data.get("metrics")),
                    "metadata": _json_or_none(data.get("metadata")),
                    "tools": _json_or_none(data.get("tools")),
                    "logs": data.get("logs") or None,
                    "messages": _flat_messages(trajectory),
                }
            )
    schema = _schema(pa)
    table = pa.Table.from_pylist(rows, schema=schema) if rows else schema.empty_table()
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        pq.write_table(table, partial, compression="zstd")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _json_or_none(value: Any) -> str | None:
    return _json(value) if value else None


def _flat_messages(trajectory: Trajectory) -> list[dict[str, Any]] | None:
    """ART's query-friendly `messages` column; None when a message's content is not text
    (content parts), which only the JSON column can hold."""
    flat = []
    for item in trajectory.messages_and_choices:
        if is_choice(item):
            message = item.message.model_dump(mode="json", exclude_unset=True)
            row = {
                "role": message.get("role") or "assistant",
                "content": message.get("content"),
                "tool_calls": message.get("tool_calls"),
                "tool_call_id": None,
                "trainable": True,
            }
        elif isinstance(item, Mapping):
            row = {
                "role": item.get("role"),
                "content": item.get("content"),
                "tool_calls": item.get("tool_calls"),
                "tool_call_id": item.get("tool_call_id"),
                "trainable": False,
            }
        else:  # what a Trajectory admits is a message dict or a Choice
            raise TypeError(f"a trajectory item is a {type(item).__name__}, neither a message dict nor a Choice")
        if row["content"] is not None and not isinstance(row["content"], str):
            return None
        row["tool_calls"] = _json(row["tool_calls"]) if row["tool_calls"] else None
        flat.append(row)
    return flat


# -- reading ------------------------------------------------------------------------------


def read_groups(path: str | Path) -> list[TrajectoryGroup]:
    """The groups of a file this module or ART wrote (version 2, or ART's unversioned
    version 1). A file that contradicts its own layout raises ArtValueError naming what."""
    _, pq = _pyarrow()
    schema = pq.read_schema(path)
    raw = (schema.metadata or {}).get(VERSION_KEY)
    try:
        version = int(raw) if raw is not None else None
    except ValueError:
        raise ArtValueError(
            f"{path}: invalid trajectory Parquet version metadata {raw!r}", field="format_version"
        ) from None
    if version not in (None, FORMAT_VERSION):
        raise ArtValueError(
            f"{path}: Unsupported trajectory Parquet version: {version} (this library reads "
            f"ART's unversioned files and version {FORMAT_VERSION})",
            field="format_version",
        )
    names = set(schema.names)
    marked = "format_version" in names
    if version == FORMAT_VERSION and not marked:
        raise ArtValueError(
            f"{path}: a version {FORMAT_VERSION} trajectory file is missing format_version, its version column",
            field="format_version",
        )
    if not marked and names & {"group_json", "trajectory_json"}:
        raise ArtValueError(
            f"{path}: a trajectory file with ART's JSON columns is missing its version marker "
            "(the format_version column)",
            field="format_version",
        )
    rows = pq.read_table(path).to_pylist()
    if marked and version is None and not rows:
        raise ArtValueError(
            f"{path}: an empty versioned trajectory file is missing its version metadata", field="format_version"
        )
    if not rows:
        return []
    return _read_versioned(rows, path) if marked else _read_flat(rows, path)


def _read_versioned(rows: list[dict[str, Any]], path: str | Path) -> list[TrajectoryGroup]:
    by_group = _rows_by_group(rows, path)
    return [_read_group(group_index, by_group[group_index], path) for group_index in range(len(by_group))]


def _rows_by_group(rows: list[dict[str, Any]], path: str | Path) -> dict[int, list[dict[str, Any]]]:
    """The rows of each group, once every row is known to be version 2 and the groups to run 0 to n - 1."""
    by_group: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("format_version") != FORMAT_VERSION:
            raise ArtValueError(
                f"{path}: Unsupported trajectory Parquet version: {row.get('format_version')!r} in a row",
                field="format_version",
            )
        by_group.setdefault(_index(row.get("group_index"), "group_index", path), []).append(row)
    if sorted(by_group) != list(range(len(by_group))):
        raise ArtValueError(
            f"{path}: its group indexes are duplicate or non-contiguous ({sorted(by_group)}, "
            f"expected 0 to {len(by_group) - 1})",
            field="group_index",
        )
    return by_group


def _read_group(group_index: int, members: list[dict[str, Any]], path: str | Path) -> TrajectoryGroup:
    """One group back from its rows: the group's JSON, shared by every row, and its trajectories in order."""
    payloads = {row.get("group_json") for row in members}
    if len(payloads) != 1:
        raise ArtValueError(f"{path}: group {group_index} has conflicting group_json rows", field="group_json")
    group_data = _json_object(payloads.pop(), path, f"group {group_index}'s group_json", "group_json")
    trajectories = [
        Trajectory.from_logging(
            _json_object(text, path, f"group {group_index}'s trajectory {index}", "trajectory_json"),
            where=f"trajectory_groups[{group_index}].trajectories[{index}]",
        )
        for index, text in _trajectory_rows(group_index, members, path)
    ]
    return TrajectoryGroup(
        trajectories,
        exceptions=group_data.get("exceptions") or (),
        metadata=group_data.get("metadata"),
        metrics=group_data.get("metrics"),
        logs=group_data.get("logs") or (),
    )


def _trajectory_rows(group_index: int, members: list[dict[str, Any]], path: str | Path) -> list[tuple[int, Any]]:
    """(index, trajectory_json) of a group's trajectories in order, once they run 0 to n - 1 and a
    group without any keeps exactly one placeholder row."""
    placeholders = [row for row in members if row.get("trajectory_index") is None]
    if any(row.get("trajectory_json") is not None for row in placeholders):
        raise ArtValueError(
            f"{path}: group {group_index} has a trajectory without a trajectory_index", field="trajectory_index"
        )
    indexed = sorted(
        (
            (_index(row["trajectory_index"], "trajectory_index", path), row["trajectory_json"])
            for row in members
            if row.get("trajectory_index") is not None
        ),
        key=lambda p: p[0],
    )
    if [index for index, _ in indexed] != list(range(len(indexed))):
        raise ArtValueError(
            f"{path}: group {group_index} has duplicate or missing trajectories "
            f"(indexes {[index for index, _ in indexed]})",
            field="trajectory_index",
        )
    if len(placeholders) != (0 if indexed else 1):
        raise ArtValueError(
            f"{path}: group {group_index} must have trajectories or exactly one row without, "
            f"got {len(indexed)} and {len(placeholders)}",
            field="trajectory_index",
        )
    return indexed


def _read_flat(rows: list[dict[str, Any]], path: str | Path) -> list[TrajectoryGroup]:
    """ART's version 1: flat columns only; `group_index` and the group columns may be absent."""
    members: dict[int, list[Trajectory]] = {}
    group_rows: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row.get("reward") is None and row.get("messages") is None:
            continue
        group_index = _index(row.get("group_index", 0), "group_index", path)
        group_rows.setdefault(group_index, row)
        reward = row.get("reward")
        if not is_number(reward):
            raise ArtValueError(
                f"{path}: group {group_index} has a trajectory whose reward is {reward!r}, not a number", field="reward"
            )
        messages = [_unflatten(m) for m in row.get("messages") or []]
        members.setdefault(group_index, []).append(
            Trajectory.model_validate(  # the row's message dicts are checked as a Trajectory checks any
                {
                    "messages_and_choices": messages,
                    "reward": float(reward),
                    "metrics": _lenient_object(row.get("metrics")),
                    "metadata": _lenient_object(row.get("metadata")),
                    "logs": [str(line) for line in row.get("logs") or []],
                    "tools": _lenient_list(row.get("tools")),
                    "additional_histories": _histories(row.get("additional_histories")),
                }
            )
        )
    return [
        TrajectoryGroup(
            members[index],
            metadata=_lenient_object(group_rows[index].get("group_metadata")),
            metrics=_lenient_object(group_rows[index].get("group_metrics")),
            logs=[str(line) for line in group_rows[index].get("group_logs") or []],
        )
        for index in sorted(members)
    ]


def _unflatten(row: Mapping[str, Any]) -> dict[str, Any]:
    message = {"role": row.get("role"), "content": row.get("content")}
    if row.get("tool_calls"):
        message["tool_calls"] = json.loads(row["tool_calls"])
    if row.get("tool_call_id"):
        message["tool_call_id"] = row["tool_call_id"]
    return message


def _index(value: Any, field: str, path: str | Path) -> int:
    if not is_int(value):
        raise ArtValueError(f"{path}: {field} must be an integer, got {value!r}", field=field)
    return value


def _json_object(text: Any, path: str | Path, what: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, dict):
        raise ArtValueError(f"{path}: {what} is not a JSON object", field=field)
    return value


def _lenient_list(text: Any) -> list[Any] | None:
    """A version 1 JSON list column (`tools`); None when empty or not a list."""
    try:
        value = json.loads(text) if text else None
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, list) and value else None


def _histories(text: Any) -> list[History]:
    """The `additional_histories` column ART's JSONL migration wrote ({messages_and_choices,
    tools} each); Choices among them come back as Choices."""
    histories = []
    for entry in _lenient_list(text) or []:
        if isinstance(entry, dict):
            histories.append(
                History(
                    messages_and_choices=[
                        _choice_or_dict(item)
                        for item in entry.get("messages_and_choices") or []
                        if isinstance(item, dict)
                    ],
                    tools=entry.get("tools") or None,
                )
            )
    return histories


def _choice_or_dict(item: dict[str, Any]) -> Any:
    """A dumped chat Choice (a `message`, no `role` of its own) as a Choice; anything else, and a
    choice-shaped dict that is not a valid Choice (ART keeps those verbatim), as given."""
    if "message" in item and "role" not in item:
        try:
            return Choice.model_validate(item)
        except ValueError:
            return item
    return item


def _lenient_object(text: Any) -> dict[str, Any]:
    """ART's version 1 columns hold a JSON object or nothing; anything else reads as empty."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
