"""Judge answers on disk, so a rerun (or a resumed run) does not pay the judge again.

One JSON file per answer, named by the SHA-256 of everything that decides the answer: the judge
model, where it is served, the full judge prompt (which holds the rubric and the trajectories)
and the request's sampling settings and response format. Files are written to a temporary
name and renamed, so a killed run leaves no half answer. Delete the folder to clear it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


class JudgeCache:
    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)

    @staticmethod
    def key(request: dict[str, Any], endpoint: str) -> str:
        blob = json.dumps({"endpoint": endpoint, "request": request}, sort_keys=True, ensure_ascii=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> str | None:
        """The cached answer text, or None (a missing or unreadable entry is a miss)."""
        try:
            return json.loads((self.folder / f"{key}.json").read_text())["content"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, content: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"content": content}, f)
            os.replace(tmp, self.folder / f"{key}.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
