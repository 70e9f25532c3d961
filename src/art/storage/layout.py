"""Where each file of a model's run lives."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_name(value: str, field: str) -> str:
    """Project and model names become folder names: no separators, no traversal."""
    from art.errors import ArtValueError

    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        from art.naming import echo

        raise ArtValueError(
            f"{field} {echo(value)} is not a valid name: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            field=field,
        )
    return value


class ModelDir:
    """Paths of one model's run folder."""

    def __init__(self, root: str | Path, project: str, name: str) -> None:
        validate_name(project, "project")
        validate_name(name, "name")
        self.path = Path(root) / project / "models" / name

    @property
    def model_json(self) -> Path:
        return self.path / "model.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def history(self) -> Path:
        return self.path / "history.jsonl"

    def trajectories(self, split: str, step: int) -> Path:
        validate_name(split, "split")
        return self.path / "trajectories" / split / f"{step:04d}.jsonl"

    def write_model_json(self, data: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.model_json, json.dumps(data, indent=2, default=str))

    def read_model_json(self) -> dict | None:
        """What `write_model_json` wrote last, or None when there is no readable one."""
        try:
            data = json.loads(self.model_json.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None


def stored_runs(root: str | Path) -> list[tuple[str, str]]:
    """(project, name) of every run under `root` with a model.json (trainable models)."""
    return sorted(
        (path.parts[-4], path.parts[-2])
        for path in Path(root).glob("*/models/*/model.json")
        if _NAME.match(path.parts[-4]) and _NAME.match(path.parts[-2])
    )


def write_atomic(path: Path, text: str) -> None:
    """Write a small file so readers see the old or the new content, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
