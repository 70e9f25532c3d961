"""Weave traces of rollouts, started as ART starts them.

`@weave.op` on a rollout needs nothing from us: without `weave.init` it is a plain call. When the
user calls `weave.init(...)`, or sets `WANDB_API_KEY` (ART's switch: `register` then calls
`weave.init(project)` once per project, as ART's backend does), Weave records each op call with
its inputs and the returned `Trajectory`, and the OpenAI calls made inside it (Weave patches
the `openai` client on init). Weave is optional (the `tracing` extra); `WEAVE_DISABLED=true`
keeps it off.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_projects: set[str] = set()


def init_weave(project: str) -> bool:
    """`weave.init(project)` once per project when W&B is configured online; True if it ran."""
    if not os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return False
    if os.environ.get("WEAVE_DISABLED", "").lower() == "true" or project in _projects:
        return False
    try:
        import weave
    except ImportError:
        return False
    os.environ.setdefault("WEAVE_PRINT_CALL_LINK", "False")  # ART's quiet defaults
    os.environ.setdefault("WEAVE_LOG_LEVEL", "CRITICAL")
    try:
        weave.init(project)
    except Exception as exc:  # an unreachable W&B never stops training
        log.warning("weave.init(%r) failed, rollouts are not traced in Weave: %s", project, exc)
        return False
    _projects.add(project)
    return True
