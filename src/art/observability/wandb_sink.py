"""Forward `model.log` rows to Weights & Biases when it is configured, as ART does.

On when `WANDB_API_KEY` is set or `WANDB_MODE=offline`, or as the model's `report_metrics` says;
`WANDB_MODE=disabled` turns it off.
One W&B run per model (id = model name, resumed across restarts), stored under the model's
run folder. Metrics are plotted against `training_step`, so rows logged out of step order
(a late validation) are kept instead of dropped. W&B is optional: without the package a
warning says how to install it, and nothing else changes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from art.metrics_taxonomy import SECTIONS, SFT_METRIC_PREFIX, SFT_WANDB_GRADIENT_STEP_KEY, TRAINING_STEP_KEY

log = logging.getLogger(__name__)

_runs: dict[tuple[str, str], Any] = {}  # wandb Run objects (wandb is imported lazily)
_warned = False


def wandb_enabled(report_metrics: list[str] | None = None) -> bool:
    """ART's rule: `report_metrics=None` means W&B when it is configured (`WANDB_API_KEY`, or
    `WANDB_MODE=offline`); a list turns W&B on exactly when it names "wandb"."""
    mode = os.environ.get("WANDB_MODE", "")
    if mode == "disabled":
        return False
    if report_metrics is not None:
        return "wandb" in report_metrics
    return bool(os.environ.get("WANDB_API_KEY")) or mode == "offline"


def log_to_wandb(model, *, step: int, metrics: dict, run_dir: Path) -> None:
    if not metrics or not wandb_enabled(getattr(model, "report_metrics", None)):
        return
    run = _run(model, run_dir)
    if run is not None:
        run.log({**metrics, TRAINING_STEP_KEY: step})


def update_config(model, config: dict) -> None:
    """Send the model's merged W&B config to its open run (nothing when none is open yet: the
    run starts with it). A nested section that grew counts as a change to W&B; leaves never
    change (`Model.update_wandb_config` refuses a conflict first), so the change is allowed."""
    run = _runs.get((model.project, model.name))
    if run is not None:
        run.config.update(config, allow_val_change=True)


def _run(model, run_dir: Path):
    global _warned
    key = (model.project, model.name)
    if key in _runs and not getattr(_runs[key], "_is_finished", False):  # a run the user finished: start anew
        return _runs[key]
    try:
        import wandb
    except ImportError:
        if not _warned:
            log.warning("W&B is configured but not installed: pip install wandb")
            _warned = True
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    user_config = model.config.model_dump() if hasattr(model.config, "model_dump") else model.config
    extra = dict(getattr(model, "wandb_config", None) or {})
    # Shown under ART's `run_name` (None: `name`); one run folder, one W&B run id: `name`.
    run = wandb.init(
        project=model.project,
        name=getattr(model, "run_name", None) or model.name,
        id=model.name,
        resume="allow",
        dir=str(run_dir),
        config={
            "model": model.name,
            "base_model": getattr(model, "base_model", None),
            "user_config": user_config,
            **extra,
        },
        reinit="create_new",
    )
    declare_taxonomy(run)
    if extra:
        run.config.update(extra)
    _runs[key] = run
    return run


def declare_taxonomy(run) -> None:
    """Plot every key against `training_step` (rows may come out of step order: a late
    validation), except SFT's per-batch rows, which go against `sft/gradient_step`."""
    run.define_metric(TRAINING_STEP_KEY)
    run.define_metric(SFT_WANDB_GRADIENT_STEP_KEY)
    for section in SECTIONS:
        if section != SFT_METRIC_PREFIX:
            run.define_metric(f"{section}/*", step_metric=TRAINING_STEP_KEY)
    run.define_metric(f"{SFT_METRIC_PREFIX}/*", step_metric=SFT_WANDB_GRADIENT_STEP_KEY)
    run.define_metric("*", step_metric=TRAINING_STEP_KEY)


def finish_wandb() -> None:
    """Close every open run (W&B also does this at exit)."""
    while _runs:
        _, run = _runs.popitem()
        run.finish()
