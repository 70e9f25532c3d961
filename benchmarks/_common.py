"""Helpers the benchmark scripts share: the machine description, ratios and the result table.

Benchmarks print a readable table and then one JSON line (the last line of stdout), so a run
can be kept in benchmarks/results/<date>-<script>.md and compared by a script.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path


def environment() -> dict:
    """What the numbers depend on: date, the `art` commit (None outside a checkout), CPUs, versions."""
    import torch
    import transformers

    import art

    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(art.__file__).parent,
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def installed_version(package: str) -> str | None:
    """A peer's version for the JSON line; None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def ratio(ours: float | None, baseline: float | None) -> float | None:
    """ours / baseline, rounded; None when either side was not measured."""
    if not ours or not baseline:
        return None
    return round(ours / baseline, 2)


def table(header: list[str], rows: list[list]) -> str:
    """A plain fixed-width table; None prints as '-'."""
    cells = [header] + [["-" if c is None else f"{c:,.1f}" if isinstance(c, float) else str(c) for c in row]
                        for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def generate_tok_s(model, pad_id: int, prompts: list[list[int]], n: int, max_tokens: int) -> float:
    """Completion tokens/s of transformers' `generate` on one left-padded batch of `prompts`, n
    samples each (temperature 1, no top-k/top-p cut), exactly `max_tokens` tokens a sample."""
    import time

    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, num_return_sequences=n,
                             pad_token_id=pad_id)
    return (out.shape[1] - width) * out.shape[0] / (time.perf_counter() - start)
