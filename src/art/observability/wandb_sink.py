"""Forward `model.log` rows to Weights & Biases when it is configured, as ART does.

On when `WANDB_API_KEY` is set or `WANDB_MODE=offline`; `WANDB_MODE=disabled` turns it off.
One W&B run per model (id = model name, resumed across restarts), stored under the model's
run folder. Metrics are plotted against `training_step`, so rows logged out of step order
(a late validation) are kept instead of dropped. W&B is optional: without the package a
warning says how to install it, and nothing else changes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

_runs: dict[tuple[str, str], object] = {}
_warned = False


def wandb_enabled() -> bool:
    mode = os.environ.get("WANDB_MODE", "")
    if mode == "disabled":
        return False
    return bool(os.environ.get("WANDB_API_KEY")) or mode == "offline"


def log_to_wandb(model, *, step: int, metrics: dict, run_dir: Path) -> None:
    if not metrics or not wandb_enabled():
        return
    run = _run(model, run_dir)
    if run is not None:
        run.log({**metrics, "training_step": step})


def _run(model, run_dir: Path):
    global _warned
    key = (model.project, model.name)
    if key in _runs:
        return _runs[key]
    try:
        import wandb
    except ImportError:
        if not _warned:
            log.warning("W&B is configured but not installed: pip install wandb")
            _warned = True
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    config = model.config.model_dump() if hasattr(model.config, "model_dump") else model.config
    run = wandb.init(project=model.project, name=model.name, id=model.name, resume="allow",
                     dir=str(run_dir), config={"model": model.name, "base_model": getattr(model, "base_model", None),
                                               "user_config": config},
                     reinit="create_new")
    run.define_metric("training_step")
    run.define_metric("*", step_metric="training_step")
    _runs[key] = run
    return run


def finish_wandb() -> None:
    """Close every open run (W&B also does this at exit)."""
    while _runs:
        _, run = _runs.popitem()
        run.finish()
