"""`history.jsonl`: one JSON row per logged step, appended and fsynced.

A row holds ART's keys only: `step`, `recorded_at`, `training_step` and the metrics. Its split is
not a key of its own (ART's readers allow no other key); it is in the metric names, which
`model.log` routes (`val/reward`, `train/loss`; art.metrics_taxonomy). `row_split` reads it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from art.metrics_taxonomy import SECTIONS

NOT_SPLITS = frozenset({*SECTIONS, "checkpoint", "queue"})
"""First name parts that say what a metric is, never which split logged it: the taxonomy's
sections, and the pipeline's checkpoint and queue rows."""


def append_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def append_history(path: Path, row: dict) -> None:
    append_jsonl(path, [row])


def read_history(path: Path) -> list[dict]:
    """All complete rows; a line cut short by a crash is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def row_split(row: dict) -> str | None:
    """The split a history row was logged for: the one first name part of its metrics that is
    not a section (`val/reward` -> "val"), or the `split` key rows written before carried. A
    row of ART's "discarded" split (set-aside groups) has only section names, `discarded/…`
    among them: "discarded". None when the names say none (only `time/…`, `data/…` or
    `checkpoint/…` keys) or several."""
    legacy = row.get("split")
    if isinstance(legacy, str):
        return legacy
    heads = {key.split("/", 1)[0] for key in row if isinstance(key, str) and "/" in key}
    splits = heads - NOT_SPLITS
    if not splits and "discarded" in heads:
        return "discarded"
    return splits.pop() if len(splits) == 1 else None


def rows_for_split(rows: list[dict], split: str) -> list[dict]:
    """The rows `row_split` files under `split`."""
    return [row for row in rows if row_split(row) == split]
