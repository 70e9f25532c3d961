"""Checkpoint folders `checkpoints/{step:04d}/` that appear only when complete.

A checkpoint is written into a hidden temp folder beside the others, every file fsynced,
then renamed into place: a crash at any moment leaves either no folder for that step or a
whole one. Leftover temp folders of crashed writes are removed on open.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

_STEP = re.compile(r"^\d{4,}$")


class CheckpointStore:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def steps(self) -> list[int]:
        return complete_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.directory / f"{step:04d}"

    def write(self, step: int, fill: Callable[[Path], None], *, replace: bool = False) -> Path:
        """Call `fill(folder)` to write the files, then publish the folder as `step`. With
        `replace`, an existing `step` is swapped for the new folder only once it is complete
        (a crash between the two renames leaves no folder for `step`, never a partial one)."""
        final = self.path(step)
        if final.exists() and not replace:
            raise FileExistsError(f"checkpoint {final} already exists")
        tmp = Path(tempfile.mkdtemp(dir=self.directory, prefix=f".tmp-{step:04d}-"))
        old, moved = self.directory / f".tmp-replaced-{step:04d}", False
        try:
            fill(tmp)
            for file in tmp.rglob("*"):
                if file.is_file():
                    _fsync(file)
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                moved = True
            os.rename(tmp, final)
            _fsync(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if moved and not final.exists():  # put the replaced step back
                os.rename(old, final)
            raise
        if moved:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def delete(self, step: int) -> None:
        # Rename first so a crash mid-delete never leaves a half checkpoint under a step name.
        doomed = self.directory / f".tmp-deleting-{step:04d}"
        os.rename(self.path(step), doomed)
        shutil.rmtree(doomed)


def complete_steps(directory: Path) -> list[int]:
    """The steps of the complete checkpoints in `directory` (none when it does not exist), read
    without the store's clean-up of leftover temp folders."""
    if not Path(directory).is_dir():
        return []
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.is_dir() and _STEP.match(p.name))


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entry to disk (a folder's for the rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
