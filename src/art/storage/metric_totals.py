"""The run's running totals (`metric_totals.json` beside `history.jsonl`), applied to each row
as it is written: cost roll-ups, `*/cum/*`, unique scenarios, throughput (art.metrics_taxonomy).

One lock per run folder: `model.log` runs in a worker thread, and an evaluation may log while a
step does. The row is appended before the totals are saved, so a crash between the two loses at
most that row's share of the totals, never writes totals for a row that is not there.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path

from art.metrics_taxonomy import CumulativeTotals
from art.storage.history import append_history
from art.storage.layout import write_atomic

TOTALS_FILE = "metric_totals.json"

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(folder: Path) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(folder.resolve(), threading.Lock())


def read_totals(folder: Path) -> CumulativeTotals:
    try:
        return CumulativeTotals(json.loads((folder / TOTALS_FILE).read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        return CumulativeTotals()


def append_with_totals(history: Path, row: dict, scenario_ids: Iterable[str] = ()) -> dict:
    """Append `row` with what it derives; the row as written."""
    folder = history.parent
    with _lock(folder):
        totals = read_totals(folder)
        row = {**row, **totals.derive(row, scenario_ids)}
        append_history(history, row)
        write_atomic(folder / TOTALS_FILE, json.dumps(totals.state_dict()))
    return row
