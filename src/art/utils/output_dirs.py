"""ART's `art.utils.output_dirs`: where a run's files live, as strings, for scripts that reach
into a run folder (pull a checkpoint into place, read trajectories). The layout is the one
`art.storage.layout.ModelDir` writes: `{art_path}/{project}/models/{name}/`."""

from __future__ import annotations

import os

from art.storage.layout import ModelDir, validate_name
from art.utils.get_repo_root_path import get_repo_root_path


def get_default_art_path() -> str:
    """`.art` at the repository root (ART's default); `LocalBackend()` without `path` uses `.art`
    in the current directory, the same folder when scripts run from the root."""
    return os.path.join(get_repo_root_path(), ".art")


def get_models_dir(project_name: str, art_path: str | None = None) -> str:
    return os.path.join(art_path or get_default_art_path(), validate_name(project_name, "project_name"), "models")


def get_output_dir_from_model_properties(project: str, name: str, art_path: str | None = None) -> str:
    return str(ModelDir(art_path or get_default_art_path(), project, name).path)


def get_model_dir(model, art_path: str | None = None) -> str:
    """The run folder of `model` (an `art.Model`) under `art_path` (a backend's `root`)."""
    return get_output_dir_from_model_properties(model.project, model.name, art_path)


def get_step_checkpoint_dir(model_output_dir: str, step: int) -> str:
    """The folder of checkpoint `step`: `checkpoints/{step:04d}` in the run folder (where
    LocalBackend saves and loads it; ART's older layout had no `checkpoints/` level)."""
    return os.path.join(model_output_dir, "checkpoints", f"{step:04d}")


def get_trajectories_dir(model_output_dir: str) -> str:
    return os.path.join(model_output_dir, "trajectories")


def get_trajectories_split_dir(model_output_dir: str, split: str) -> str:
    return os.path.join(model_output_dir, "trajectories", split)


def get_benchmarks_dir(project: str, art_path: str | None = None) -> str:
    return os.path.join(art_path or get_default_art_path(), project, "benchmarks")
