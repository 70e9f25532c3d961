"""Which (model, split) a chart draws, and under what label (ART's `BenchmarkModelKey`)."""

from __future__ import annotations


class BenchmarkModelKey:
    """A model's rows of one split, shown as `display_name`: `BenchmarkModelKey("agent-001",
    "Agent", "train")`. The split defaults to "val", where prompted baselines are logged."""

    def __init__(self, name: str, display_name: str | None = None, split: str | None = "val") -> None:
        self.name = name
        self.display_name = display_name or name
        self.split = split

    def __repr__(self) -> str:
        return f"BenchmarkModelKey({self.name!r}, {self.display_name!r}, {self.split!r})"

    def __str__(self) -> str:
        return self.display_name
