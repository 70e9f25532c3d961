"""Trajectory groups to files and back, under the names of OpenPipe ART's `art.utils.trajectory_logging`.

- Parquet, ART's current layout: `write_trajectory_groups_parquet` / `read_trajectory_groups_parquet`
  (pyarrow needed). `model.log` writes the same layout beside each step's JSONL when pyarrow
  is installed (`trajectories/{split}/{step:04d}.parquet`), so ART code reads our runs.
- JSON lines, ART's earlier layout: `serialize_trajectory_groups` / `deserialize_trajectory_groups`,
  one group per line, choices without their logprobs (for reading, not for training again).
  `deserialize_trajectory_groups` also reads our run log's step files (one trajectory per line
  with its `group` index) and, with PyYAML installed, ART's oldest YAML logs.
- The dict helpers both use (`trajectory_to_dict`, `dict_to_trajectory`, ...).

Reading restores `Trajectory` and `TrajectoryGroup` objects; invalid data raises ArtValueError
(a ValueError) naming what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic_core import to_jsonable_python

from art.errors import ArtValueError
from art.numeric import is_int
from art.storage import trajectory_parquet
from art.trajectories import History, Trajectory, TrajectoryGroup, is_choice


def write_trajectory_groups_parquet(trajectory_groups: Iterable[TrajectoryGroup], path: str | Path) -> None:
    """Write the groups to a ZSTD-compressed Parquet file in ART's layout (replacing it)."""
    trajectory_parquet.write_groups(trajectory_groups, path)


def read_trajectory_groups_parquet(path: str | Path) -> list[TrajectoryGroup]:
    """The groups of a Parquet file written by us or by ART (its versioned layout restores
    everything; its older unversioned one gives choices back as plain assistant messages)."""
    return trajectory_parquet.read_groups(path)


# -- JSON lines ---------------------------------------------------------------------------


def serialize_trajectory_groups(trajectory_groups: Iterable[TrajectoryGroup]) -> str:
    """One JSON line per group (`trajectory_group_to_dict`)."""
    return "\n".join(json.dumps(trajectory_group_to_dict(group)) for group in trajectory_groups)


def trajectory_group_to_dict(trajectory_group: TrajectoryGroup) -> dict[str, Any]:
    """{"trajectories": [...]} as ART writes it, plus the group's metadata, metrics, logs and
    exceptions (ART's reader ignores them; ours restores them)."""
    return {
        "trajectories": [trajectory_to_dict(t) for t in trajectory_group.trajectories if isinstance(t, Trajectory)],
        "metadata": _jsonable(trajectory_group.metadata),
        "metrics": _jsonable(trajectory_group.metrics),
        "logs": list(trajectory_group.logs),
        "exceptions": [e.model_dump(mode="json") for e in trajectory_group.exceptions],
    }


def trajectory_to_dict(trajectory: Trajectory) -> dict[str, Any]:
    return {
        "reward": trajectory.reward,
        "metrics": _jsonable(trajectory.metrics),
        "metadata": _jsonable(trajectory.metadata),
        "messages_and_choices": [message_or_choice_to_dict(item) for item in trajectory.messages_and_choices],
        "tools": _jsonable(trajectory.tools),
        "additional_histories": [history_to_dict(history) for history in trajectory.additional_histories],
        "logs": list(trajectory.logs),
    }


def history_to_dict(history: History) -> dict[str, Any]:
    return {
        "messages_and_choices": [message_or_choice_to_dict(item) for item in history.messages_and_choices],
        "tools": _jsonable(history.tools),
    }


def message_or_choice_to_dict(message_or_choice: Any) -> dict[str, Any]:
    """A message dict as given, a Choice as the fields that were set; either without its
    `logprobs` (as ART logs them: for reading). The input is not changed."""
    if is_choice(message_or_choice):
        dump = getattr(message_or_choice, "to_dict", None)
        item = dump() if callable(dump) else message_or_choice.model_dump(exclude_unset=True)
    else:
        item = dict(message_or_choice)
        if isinstance(item.get("content"), Iterator):  # a generator of content parts
            item["content"] = list(item["content"])
    item.pop("logprobs", None)
    return _jsonable(item)


def deserialize_trajectory_groups(serialized: str) -> list[TrajectoryGroup]:
    """Groups from JSON lines: ART's (one group per line) or our run log's (one trajectory per
    line, grouped by its `group` index, in index order after any whole groups). Text that is
    not JSON lines is read as ART's older YAML, when PyYAML is installed."""
    entries = _entries(serialized)
    groups: list[TrajectoryGroup] = []
    rows: dict[int, list[Trajectory]] = {}
    for number, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ArtValueError(f"entry {number} is a {type(entry).__name__}, not a JSON object", field=f"[{number}]")
        if "trajectories" in entry:
            groups.append(dict_to_trajectory_group(entry))
        else:
            group = entry.get("group", 0)
            if not is_int(group):
                raise ArtValueError(
                    f"entry {number} has neither 'trajectories' (a group) nor an integer 'group' (a run log line)",
                    field=f"[{number}].group",
                )
            rows.setdefault(group, []).append(dict_to_trajectory(entry))
    return [*groups, *(TrajectoryGroup(rows[index]) for index in sorted(rows))]


def _entries(serialized: str) -> list[Any]:
    lines = [line for line in serialized.strip().splitlines() if line.strip()]
    try:
        return [json.loads(line) for line in lines]
    except json.JSONDecodeError as not_json:
        try:
            import yaml
        except ImportError:
            raise ArtValueError(
                f"not JSON lines ({not_json}); ART's older YAML logs need PyYAML (pip install pyyaml)",
                field="serialized",
            ) from not_json
        loaded = yaml.safe_load(serialized)
        if not isinstance(loaded, list):
            raise ArtValueError("neither JSON lines nor a YAML list of groups", field="serialized") from not_json
        return loaded


def dict_to_trajectory_group(data: Mapping[str, Any]) -> TrajectoryGroup:
    return TrajectoryGroup(
        [dict_to_trajectory(t) for t in data.get("trajectories") or []],
        exceptions=data.get("exceptions") or (),
        metadata=data.get("metadata"),
        metrics=data.get("metrics"),
        logs=data.get("logs") or (),
    )


def dict_to_trajectory(data: Mapping[str, Any]) -> Trajectory:
    """A Trajectory from `trajectory_to_dict`'s dict or a run log line; dumped choices become
    Choices again (with token ids and logprobs when the dict kept them)."""
    return Trajectory.from_logging(
        {key: value for key, value in data.items() if key in Trajectory.model_fields and value is not None}
    )


def dict_to_message_or_choice(data: Mapping[str, Any]) -> Any:
    """A dumped Choice (it has a `message`) becomes a Choice; a message stays a dict."""
    if isinstance(data, Mapping) and "message" in data and "role" not in data:
        return Choice.model_validate(dict(data))
    return dict(data)


def _jsonable(value: Any) -> Any:
    return to_jsonable_python(value, serialize_unknown=True)
