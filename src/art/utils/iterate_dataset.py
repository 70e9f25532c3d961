"""Batches of scenarios per training step, shuffled per epoch and resumable from any step.

The shuffle of epoch `e` depends only on `seed + e`, so a loop restarted with
`initial_step=await model.get_step()` sees exactly the batches it had not trained on yet.
"""

from __future__ import annotations

import math
import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from art.numeric import is_int

from ..errors import ArtValueError
from ..observability.progress import progress_bar

T = TypeVar("T")


@dataclass
class DatasetBatch(Generic[T]):
    """The items of one training step."""

    items: list[T]
    step: int
    """Global step, from 0 across epochs."""
    epoch: int
    epoch_step: int
    """Step within the epoch, from 0."""


def iterate_dataset(
    dataset: Sequence[T],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
    seed: int = 42,
) -> Generator[DatasetBatch[T], None, None]:
    """Yield `groups_per_step` items per step for `num_epochs` epochs, skipping steps before `initial_step`.

    Each epoch is a fresh deterministic shuffle (`random.Random(seed + epoch)`); its last batch
    may be smaller than `groups_per_step`.
    """
    problems = [
        f"{name} must be an int >= {low}, got {value!r}"
        for name, value, low in (
            ("groups_per_step", groups_per_step, 1),
            ("num_epochs", num_epochs, 0),
            ("initial_step", initial_step, 0),
        )
        if not is_int(value) or value < low
    ]
    if problems:
        raise ArtValueError("invalid iterate_dataset(): " + "; ".join(problems))
    size = len(dataset)
    steps_per_epoch = math.ceil(size / groups_per_step)
    total_steps = steps_per_epoch * num_epochs
    if initial_step >= total_steps:
        return
    pbar = None
    if use_tqdm:
        pbar = progress_bar(initial=initial_step, total=total_steps, desc="Iterating dataset", unit="batch")
    try:
        for epoch in range(initial_step // steps_per_epoch, num_epochs):
            indices = list(range(size))
            random.Random(seed + epoch).shuffle(indices)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                chunk = indices[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
                items = [dataset[i] for i in chunk]
                yield DatasetBatch(items=items, step=step, epoch=epoch, epoch_step=epoch_step)
                if pbar is not None:
                    pbar.update(1)
    finally:
        if pbar is not None:
            pbar.close()
