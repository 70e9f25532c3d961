"""Progress bars that suit where they are written.

On a terminal, tqdm's bar. Elsewhere (a CI log, `| tee`, a file, a pipe) tqdm redraws its bar
with carriage returns, which pile up as hundreds of fragments on one line; there each update is
one plain line instead, e.g.

    pipeline: 1/2 step [00:03<00:03, 3.1 s/step, reward=0.5, off_policy=0, dropped=0, running=2, ready=1]

and nothing else is written (no `\\r`, no cursor moves, no line when the bar only clears or
redraws). In a notebook, tqdm's own widget. Every bar of the package is made here
(`progress_bar`), so they all behave alike.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import autonotebook
from tqdm.auto import tqdm as auto_tqdm
from tqdm.std import tqdm as std_tqdm

__all__ = ["LineProgress", "progress_bar", "writes_to_terminal"]


def writes_to_terminal(file: Any = None) -> bool:
    """Whether `file` (tqdm's default: stderr) is a terminal."""
    file = sys.stderr if file is None else file
    isatty = getattr(file, "isatty", None)
    try:
        return bool(callable(isatty) and isatty())
    except (ValueError, OSError):  # closed, or not a real stream
        return False


class LineProgress(std_tqdm):
    """A tqdm whose every update is one line of text (for a stream that is not a terminal).

    A line is written when the count moved since the last line (so `set_postfix(...,
    refresh=False)` before `update()` puts the postfix on that step's line), and at `close()`
    when what the last line said changed. `tqdm.write` around it writes only its own text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._printed: tuple | None = None  # what the last line said (`_state`); set before tqdm draws
        kwargs.update(mininterval=0, miniters=1, dynamic_ncols=False, delay=0)
        kwargs.pop("ncols", None)
        super().__init__(*args, **kwargs)

    def _state(self) -> tuple:
        d = self.format_dict
        return self.n, d["total"], d["prefix"], d["postfix"]

    def _line(self) -> str:
        d = self.format_dict
        total, unit, elapsed = d["total"], d["unit"] or "it", d["elapsed"]
        rate = d["rate"] or ((self.n - self.initial) / elapsed if elapsed else None)
        timing = self.format_interval(elapsed)
        if rate:
            if total and total > self.n:
                timing += f"<{self.format_interval((total - self.n) / rate)}"
            timing += f", {self.format_sizeof(rate)} {unit}/s" if rate >= 1 else f", {1 / rate:.3g} s/{unit}"
        prefix = f"{d['prefix']}: " if d["prefix"] else ""
        done = f"{self.n}/{total}" if total else f"{self.n}"
        postfix = f", {d['postfix']}" if d["postfix"] else ""
        return f"{prefix}{done} {unit} [{timing}{postfix}]"

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:  # tqdm's signature; both unused
        if self._printed is None:  # tqdm's first draw at construction: nothing happened yet
            self._printed = self._state()
        elif self.n != self._printed[0]:
            self._emit()
        return True

    def _emit(self) -> None:
        self._printed = self._state()
        try:
            self.fp.write(self._line() + "\n")
            self.fp.flush()
        except (ValueError, OSError):  # the stream was closed under us
            pass

    def clear(self, nolock: bool = False) -> None:  # a line once written stays
        return None

    def moveto(self, n: int) -> None:  # lines are never redrawn in place
        return None

    def close(self) -> None:
        """A last line where the count or the postfix moved since the line before; then tqdm's
        own close, which writes nothing here."""
        if getattr(self, "disable", True):
            return
        if self._printed is not None and self._state() != self._printed and self.n != self.initial:
            self._emit()
        self.sp = None
        super().close()


def progress_bar(*args: Any, **kwargs: Any) -> std_tqdm:
    """A tqdm bar (same arguments) where its stream is a terminal or a notebook shows it;
    elsewhere a `LineProgress`: one plain line per update."""
    if autonotebook.tqdm is not std_tqdm or writes_to_terminal(kwargs.get("file")):
        return auto_tqdm(*args, **kwargs)
    return LineProgress(*args, **kwargs)
