"""Checkpoint forks: model B starts from model A's checkpoint (ART's `_experimental_fork_checkpoint`).

The chosen checkpoint of A (its latest, or its last at or before `not_after_step`) is copied
into B's `checkpoints/` under the same step number, so B continues A's step count and
optimizer state as if it had trained those steps itself. The copy is a checkpoint write like
any other (`CheckpointStore.write`: a temp folder beside the others, fsynced, renamed), and
B's `model.json` records where it came from under `forked_from`. Only checkpoints move;
A's history and trajectories stay A's (as in ART).

B may be fresh (no run, or only the untrained step 0 its registration saved) and then holds
exactly the forked step afterwards. A B with trained steps of its own is refused: a fork would
mix two lineages under one name. Forking the same source step into B again is a no-op, so a
script that forks before registering can be run again after B has trained.

This module only plans and copies files; loading the weights into a registered B is
`art.service.update.load_fork`'s job. No torch here.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from art.errors import ArtValueError
from art.naming import echo
from art.storage.checkpoints import CheckpointStore
from art.storage.layout import ModelDir


@dataclass(frozen=True)
class ForkPlan:
    """What a fork will do, checked before anything is written."""

    source: ModelDir
    step: int
    """The source step copied; B's step afterwards."""
    record: dict
    """What B's model.json keeps under `forked_from`."""
    done_already: bool = False
    """B was forked from this very step before (and may have trained since): nothing to copy."""


def plan_fork(
    root: str | Path,
    source: tuple[str, str],
    dest: tuple[str, str],
    *,
    base_model: str,
    lora: dict | None | str = "unknown",
    not_after_step: int | None = None,
) -> ForkPlan:
    """Check a fork of `source` (project, name) into `dest` under `root`; raise ArtValueError
    naming the field (`from_model`, `not_after_step`, `base_model`, ...). `lora`: B's LoRA settings
    (None: fully fine-tuned), compared with A's when both are known."""
    if not_after_step is not None and (type(not_after_step) is not int or not_after_step < 0):
        raise ArtValueError(
            f"not_after_step must be an int >= 0 or None, got {echo(not_after_step)}", field="not_after_step"
        )
    if tuple(source) == tuple(dest):
        raise ArtValueError(f"cannot fork {source[0]}/{source[1]} into itself", field="from_model")
    src, dst = ModelDir(root, *source), ModelDir(root, *dest)
    steps = _steps(src.checkpoints)
    if not steps:
        raise ArtValueError(
            f"no checkpoints of model {source[0]}/{source[1]} under {root} to fork from "
            "(check from_model and from_project)",
            field="from_model",
        )
    eligible = [s for s in steps if not_after_step is None or s <= not_after_step]
    if not eligible:
        raise ArtValueError(
            f"{source[0]}/{source[1]} has no checkpoint at or before step {not_after_step} (its steps: {steps})",
            field="not_after_step",
        )
    step = eligible[-1]
    stored = src.read_model_json() or {}
    if isinstance(stored.get("base_model"), str) and stored["base_model"] != base_model:
        raise ArtValueError(
            f"{source[0]}/{source[1]} was trained on base_model {echo(stored['base_model'])}, but "
            f"{dest[0]}/{dest[1]} uses {echo(base_model)}: a checkpoint only fits its own base model",
            field="base_model",
        )
    if lora != "unknown" and "lora" in stored and _jsonable(stored["lora"]) != _jsonable(lora):
        raise ArtValueError(
            f"{source[0]}/{source[1]}'s adapter settings {echo(stored['lora'])} differ from "
            f"{dest[0]}/{dest[1]}'s {echo(lora)}: its checkpoint would not load",
            field="internal_config",
        )
    record = {"project": source[0], "name": source[1], "step": step}
    previous = (dst.read_model_json() or {}).get("forked_from")
    own = _steps(dst.checkpoints)
    if isinstance(previous, dict) and {k: previous.get(k) for k in record} == record and step in own:
        return ForkPlan(src, step, previous, done_already=True)
    trained = [s for s in own if s != 0]
    if trained:
        raise ArtValueError(
            f"{dest[0]}/{dest[1]} already has trained checkpoints {trained}: a fork starts a model "
            "afresh. Fork into a new model name (or delete that run's folder first)",
            field="model",
        )
    return ForkPlan(src, step, {**record, "forked_at": time.time()})


def copy_checkpoint(plan: ForkPlan, store: CheckpointStore) -> Path:
    """Publish the source checkpoint as checkpoint `plan.step` of `store` (B's), replacing an
    untrained step 0 in place when the source step is 0. All or nothing: on failure B's
    checkpoints are unchanged."""
    source = plan.source.checkpoints / f"{plan.step:04d}"

    def fill(folder: Path) -> None:
        shutil.copytree(source, folder, dirs_exist_ok=True)

    return store.write(plan.step, fill, replace=plan.step == 0)


def drop_other_steps(store: CheckpointStore, keep: int) -> None:
    """After a fork: B's own untrained step 0 goes, so B's checkpoints are the forked step alone."""
    for step in store.steps():
        if step != keep:
            store.delete(step)


def _steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit() and len(p.name) >= 4)


def _jsonable(value):
    return json.loads(json.dumps(value, sort_keys=True, default=str))
