"""A thread that notices when an engine loop or a training step is stuck, and says where.

A hung server looks like a slow one from outside: requests just wait. The watchdog reads
what the backend reports (`activities()`: per model, how long its engine loop has had work
without progress, how long its training step has run) and, past a threshold, reports it: one
WARNING line with the stuck thread's Python stack (`sys._current_frames`) when it starts,
one INFO line when it is over, and `stuck()` for GET /health ("degraded" with what, which
model, for how long and the innermost frame). It only reads; it never interrupts anything.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENGINE_STALL_S = 60.0
"""Default: an engine loop with pending requests and no finished step for this long is stuck."""
TRAINING_STEP_S = 1800.0
"""Default: a training step running this long is reported (a real one may be that slow)."""


@dataclass(frozen=True)
class Activity:
    what: str
    """"engine" (the sampling loop) or "training step"."""
    model: str
    """project/name."""
    for_s: float
    """Seconds without progress while there is work (engine), or seconds running (training step)."""
    thread: int | None
    """The thread doing it, whose stack is reported."""


class Watchdog:
    """`Watchdog(backend.activities, limits={"engine": 60, "training step": 1800}).start()`;
    a limit of 0, a negative one or None turns that check off."""

    def __init__(
        self,
        activities: Callable[[], list[Activity]],
        *,
        limits: dict[str, float | None],
        interval_s: float | None = None,
    ) -> None:
        self.activities = activities
        self.limits = {what: float(limit) for what, limit in limits.items() if limit is not None and limit > 0}
        shortest = min(self.limits.values(), default=5.0)
        self.interval_s = interval_s if interval_s is not None else min(5.0, max(0.05, shortest / 4))
        self._reported: dict[tuple[str, str], dict] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def stuck(self) -> list[dict]:
        """What is past its limit now: {what, model, for_s, limit_s, where, stack}."""
        out = []
        for activity in self.activities():
            limit = self.limits.get(activity.what)
            if limit is None or activity.for_s <= limit:
                continue
            frames = _frames(activity.thread)
            out.append(
                {
                    "what": activity.what,
                    "model": activity.model,
                    "for_s": round(activity.for_s, 1),
                    "limit_s": limit,
                    "where": frames[-1] if frames else "unknown (the thread has ended)",
                    "stack": frames[-8:],
                }
            )
        return out

    def check(self) -> list[dict]:
        """One round of the thread: log what became stuck (with its whole stack) and what recovered."""
        now = self.stuck()
        current = {(s["what"], s["model"]): s for s in now}
        for key, entry in current.items():
            if key not in self._reported:
                activity = next((a for a in self.activities() if (a.what, a.model) == key), None)
                stack = _stack_text(activity.thread if activity else None)
                log.warning(
                    "watchdog: the %s of %s has been stuck for %.1f s (limit %g s), at %s; its thread's "
                    "stack (innermost last):\n%s",
                    entry["what"],
                    entry["model"],
                    entry["for_s"],
                    entry["limit_s"],
                    entry["where"],
                    stack,
                )
        for key in self._reported.keys() - current.keys():
            log.info("watchdog: the %s of %s is moving again", *key)
        self._reported = current
        return now

    # -- the thread -------------------------------------------------------------------------
    def start(self) -> Watchdog:
        if self._thread is None and self.limits:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="art-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # the watchdog must outlive whatever it watches
                log.exception("watchdog check failed")


def _frames(thread: int | None) -> list[str]:
    """The thread's stack as "path:line in function", innermost last."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    if frame is None:
        return []
    return [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in traceback.extract_stack(frame)]


def _stack_text(thread: int | None) -> str:
    frame = sys._current_frames().get(thread) if thread is not None else None
    return "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(no stack: the thread ended)"


def _short(filename: str) -> str:
    """A path relative to the sys.path entry it was imported from (art/engine/llm_engine.py)."""
    best = ""
    for entry in sys.path:
        if entry and filename.startswith(entry.rstrip(os.sep) + os.sep) and len(entry) > len(best):
            best = entry.rstrip(os.sep) + os.sep
    return filename[len(best) :] if best else filename
