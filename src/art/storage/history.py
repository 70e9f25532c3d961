"""`history.jsonl`: one JSON row per logged step, appended and fsynced."""

from __future__ import annotations

import json
import os
from pathlib import Path


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
