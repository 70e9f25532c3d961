"""OpenPipe ART's `art.utils.trajectory_migration`: a run's JSONL trajectory files become Parquet.

ART once logged each step's trajectories as `trajectories/{split}/{step:04d}.jsonl` (one group per
line, `{"trajectories": [...]}`); it now writes `{step:04d}.parquet` and converts old folders when
a model is registered (`auto_migrate_on_register`). The functions here do the same, under ART's
names and with ART's `MigrationResult`, and write ART's current Parquet layout (format version
2, `art.storage.trajectory_parquet`), which ART and this library both read.

Our own run log also writes `{step:04d}.jsonl` (one trajectory per line, with its `group` index,
token ids and logprobs), and a Parquet copy beside it; its sidecar files (`*.exceptions.jsonl`,
`*.trainer_logprobs.jsonl`) are not trajectories and are left alone. Migrating one of our files
loses nothing: the failed rollouts of its `.exceptions.jsonl` go into the Parquet too, and every
field of every trajectory is kept in its JSON column. Our backends never migrate by themselves:
the JSONL is their record, and what reads a step (`art.storage.step_files`) reads either.

The JSONL helpers (`serialize_trajectory_groups`, `deserialize_trajectory_groups`,
`trajectory_to_dict`, ...) are ART's too; they live in `art.utils.trajectory_logging`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art.errors import ArtValueError
from art.numeric import is_int
from art.storage import trajectory_parquet
from art.storage.step_files import is_sidecar
from art.trajectories import TrajectoryGroup
from art.utils.trajectory_logging import (
    deserialize_trajectory_groups,
    dict_to_message_or_choice,
    dict_to_trajectory,
    dict_to_trajectory_group,
    history_to_dict,
    message_or_choice_to_dict,
    serialize_trajectory_groups,
    trajectory_group_to_dict,
    trajectory_to_dict,
)

DRY_RUN_COMPRESSION = 25
"""A dry run's estimate of how much smaller the Parquet file is (ART's figure for trajectories)."""

__all__ = [
    "MigrationResult",
    "auto_migrate_on_register",
    "deserialize_trajectory_groups",
    "dict_to_message_or_choice",
    "dict_to_trajectory",
    "dict_to_trajectory_group",
    "history_to_dict",
    "message_or_choice_to_dict",
    "migrate_all_models",
    "migrate_jsonl_to_parquet",
    "migrate_model_dir",
    "migrate_trajectories_dir",
    "serialize_trajectory_groups",
    "trajectory_group_to_dict",
    "trajectory_to_dict",
]


@dataclass
class MigrationResult:
    """What a migration did; results add up (`a + b`)."""

    files_migrated: int = 0
    files_skipped: int = 0
    """Files that are not trajectory JSONL (another suffix, or one of our sidecars)."""
    bytes_before: int = 0
    bytes_after: int = 0
    errors: list[str] = field(default_factory=list)
    """One line per file that could not be migrated; that file is left as it was."""

    @property
    def compression_ratio(self) -> float:
        """bytes_before / bytes_after (0.0 when nothing was written)."""
        return self.bytes_before / self.bytes_after if self.bytes_after else 0.0

    @property
    def space_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def __add__(self, other: MigrationResult) -> MigrationResult:
        return MigrationResult(
            files_migrated=self.files_migrated + other.files_migrated,
            files_skipped=self.files_skipped + other.files_skipped,
            bytes_before=self.bytes_before + other.bytes_before,
            bytes_after=self.bytes_after + other.bytes_after,
            errors=self.errors + other.errors,
        )


def migrate_jsonl_to_parquet(
    jsonl_path: Path | str, delete_original: bool = True, dry_run: bool = False
) -> MigrationResult:
    """Write `X.jsonl`'s groups to `X.parquet` (replacing it) and, with `delete_original`, delete
    the JSONL. A missing or unreadable file is an entry in `errors`, never an exception; a file
    that is not trajectory JSONL is skipped. `dry_run` changes nothing and estimates the sizes."""
    path = Path(jsonl_path)
    result = MigrationResult()
    if not path.exists():
        result.errors.append(f"File not found: {path}")
        return result
    if path.suffix != ".jsonl" or is_sidecar(path):
        result.files_skipped = 1
        return result
    result.bytes_before = path.stat().st_size
    if dry_run:
        result.files_migrated = 1
        result.bytes_after = result.bytes_before // DRY_RUN_COMPRESSION
        return result
    target = path.with_suffix(".parquet")
    try:
        groups = read_jsonl_groups(path)
        trajectory_parquet.write_groups(groups, target)  # atomic: a failure leaves any old file whole
        result.bytes_after = target.stat().st_size
    except Exception as exc:  # one bad file is reported, the others still migrate
        result.errors.append(f"Error migrating {path}: {type(exc).__name__}: {exc}")
        return result
    result.files_migrated = 1
    if delete_original:
        path.unlink()
    return result


def read_jsonl_groups(path: Path | str) -> list[TrajectoryGroup]:
    """The groups of a trajectory JSONL file: ART's (a group per line) or our run log's (a
    trajectory per line, grouped by `group`, with the failures of its `.exceptions.jsonl`)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return []
    first = text.lstrip().split("\n", 1)[0]
    try:
        whole_groups = "trajectories" in json.loads(first)
    except (ValueError, TypeError):
        whole_groups = True  # not JSON lines: ART's YAML, which deserialize_trajectory_groups reads or names
    if whole_groups:
        return deserialize_trajectory_groups(text)
    return _run_log_groups(text, path.with_name(f"{path.stem}.exceptions.jsonl"))


def _run_log_groups(text: str, exceptions_path: Path) -> list[TrajectoryGroup]:
    members: dict[int, list[Any]] = {}
    for number, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        entry = json.loads(line)
        group = entry.get("group") if isinstance(entry, dict) else None
        if not is_int(group) or group < 0:
            raise ArtValueError(
                f"line {number + 1} has no group index (a run log line has an integer 'group')",
                field=f"[{number}].group",
            )
        members.setdefault(group, []).append(dict_to_trajectory(entry))
    failed: dict[int, list[Any]] = {}
    if exceptions_path.exists():
        for line in exceptions_path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line) if line.strip() else None
            if isinstance(entry, dict) and type(entry.get("group")) is int:
                failed.setdefault(entry["group"], []).extend(entry.get("exceptions") or [])
    indexes = sorted(set(members) | set(failed))
    return [TrajectoryGroup(members.get(i, []), exceptions=failed.get(i, [])) for i in indexes]


def migrate_trajectories_dir(
    trajectories_dir: Path | str,
    delete_originals: bool = True,
    dry_run: bool = False,
    progress_callback: Callable[[str], None] | None = None,
) -> MigrationResult:
    """Migrate every trajectory JSONL file under `trajectories_dir` (all splits)."""
    root = Path(trajectories_dir)
    result = MigrationResult()
    if not root.exists():
        result.errors.append(f"Directory not found: {root}")
        return result
    for path in sorted(root.rglob("*.jsonl")):
        if is_sidecar(path):
            continue
        if progress_callback is not None:
            progress_callback(str(path))
        result = result + migrate_jsonl_to_parquet(path, delete_original=delete_originals, dry_run=dry_run)
    return result


def migrate_model_dir(
    model_dir: Path | str,
    delete_originals: bool = True,
    dry_run: bool = False,
    progress_callback: Callable[[str], None] | None = None,
) -> MigrationResult:
    """Migrate one model's run folder (`{art_path}/{project}/models/{name}`); nothing to do
    without a `trajectories` folder."""
    trajectories = Path(model_dir) / "trajectories"
    if not trajectories.exists():
        return MigrationResult()
    return migrate_trajectories_dir(
        trajectories, delete_originals=delete_originals, dry_run=dry_run, progress_callback=progress_callback
    )


def migrate_all_models(
    art_path: Path | str,
    project_name: str,
    delete_originals: bool = True,
    dry_run: bool = False,
    progress_callback: Callable[[str], None] | None = None,
) -> MigrationResult:
    """Migrate every model of a project (`{art_path}/{project_name}/models/*`)."""
    models = Path(art_path) / project_name / "models"
    result = MigrationResult()
    if not models.exists():
        result.errors.append(f"Models directory not found: {models}")
        return result
    for model_dir in sorted(p for p in models.iterdir() if p.is_dir()):
        if progress_callback is not None:
            progress_callback(f"Processing model: {model_dir.name}")
        result = result + migrate_model_dir(
            model_dir, delete_originals=delete_originals, dry_run=dry_run, progress_callback=progress_callback
        )
    return result


def auto_migrate_on_register(model_dir: Path | str) -> MigrationResult:
    """ART's registration hook: migrate the folder, deleting the JSONL files; print what was
    saved and warn (RuntimeWarning) for each file that could not be migrated."""
    result = migrate_model_dir(model_dir, delete_originals=True)
    if result.files_migrated:
        print(
            f"Migrated {result.files_migrated} trajectory files to Parquet "
            f"(saved {result.space_saved / 1024 / 1024:.1f} MB)"
        )
    for error in result.errors:
        warnings.warn(error, RuntimeWarning, stacklevel=2)
    return result
