"""ART's `get_repo_root_path`: where example scripts keep their data and charts."""

from __future__ import annotations

from pathlib import Path


def get_repo_root_path() -> str:
    """The git repository that holds the current directory (the nearest parent with a `.git`),
    or the current directory when there is none. ART looks up from its own source file, which
    only finds a repository when ART runs from a checkout; a user's scripts live in theirs."""
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / ".git").exists():
            return str(folder)
    return str(here)
