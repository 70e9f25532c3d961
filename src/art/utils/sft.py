"""ART's SFT helpers (`art.utils.sft`): JSONL files of chats, learning-rate schedules, chunks.

A row of an SFT file is `{"messages": [...], "tools": [...]}` (tools optional), the OpenAI chat
format; every assistant message is trained unless `assistant_turns="last"` or it carries
`"weight": 0`. One `model.train_sft` call is one checkpoint (the step advances by one), with one
optimizer step per batch; these helpers cut a dataset into calls and give each batch its
learning rate from one schedule over the whole run, so warmup and decay span every call.

Resuming: `create_sft_dataset_iterator(..., initial_step=k)` continues at batch k, even inside
a chunk (that chunk comes back without the batches before k, so none is trained twice), and
`train_sft_from_file(initial_step=..., final_step=...)` trains a slice of the batches (both
count batches, as ART does, not checkpoints).
Client-side and torch-free.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

from tqdm.auto import tqdm

from art.errors import ArtValueError
from art.observability.progress import progress_bar
from art.trajectories import Trajectory
from art.types import TrainSFTConfig

if TYPE_CHECKING:
    from art.model import TrainableModel

Schedule = Literal["cosine", "linear", "constant"]
AssistantTurns = Literal["all", "last"]


class SFTChunk(NamedTuple):
    """One `model.train_sft` call's worth of a dataset."""

    trajectories: list[Trajectory]
    config: TrainSFTConfig
    """batch_size and one learning rate per batch of this chunk."""
    step: int
    """Index of the chunk's first batch in the whole run (what `initial_step` counts)."""
    epoch: int
    epoch_step: int
    """Index of the chunk's first batch within its epoch."""


def create_lr_schedule(
    total_steps: int, peak_lr: float, method: Schedule = "linear", warmup_steps: int = 0, min_lr: float = 0.0
) -> list[float]:
    """One learning rate per batch: a linear ramp up to `peak_lr` over `warmup_steps` (its first
    value already above `min_lr`), then `method` from `peak_lr` down to `min_lr` at the last
    batch ("constant" stays at `peak_lr`). A warmup longer than the run is cut short, not
    squeezed: the run ends part-way up the ramp (as in ART)."""
    if method not in ("cosine", "linear", "constant"):
        raise ArtValueError(f"schedule must be 'cosine', 'linear' or 'constant', got {method!r}", field="schedule_type")
    if not peak_lr > 0 or not 0 <= min_lr <= peak_lr:
        raise ArtValueError(
            f"need peak_lr > 0 and 0 <= min_lr <= peak_lr, got {peak_lr!r}, {min_lr!r}", field="peak_lr"
        )
    warmup_steps = max(0, warmup_steps)
    rates = []
    decay = total_steps - warmup_steps
    for step in range(max(total_steps, 0)):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * (step + 1) / warmup_steps)
            continue
        done = (step - warmup_steps) / (decay - 1) if decay > 1 else 0.0  # 0 at the first, 1 at the last
        if method == "cosine":
            rates.append(min_lr + (peak_lr - min_lr) * (1 + math.cos(math.pi * done)) / 2)
        elif method == "linear":
            rates.append(peak_lr - (peak_lr - min_lr) * done)
        else:
            rates.append(peak_lr)
    return rates


def get_file_row_count(file_path: str | Path) -> int:
    """Non-empty lines of a JSONL file."""
    path = _jsonl(file_path)
    with path.open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def iterate_file(
    file_path: str | Path, epochs: int = 1, shuffle_buffer_size: int = 10_000, seed: int = 42, initial_skip: int = 0
) -> Iterator[Trajectory]:
    """Trajectories of a JSONL file, `epochs` times, each epoch in its own seeded order.

    Rows pass through a buffer of `shuffle_buffer_size` from which a random one leaves as each
    new one arrives, so a file far larger than memory is shuffled locally; a buffer at least as
    large as the file shuffles it fully. `initial_skip` drops that many trajectories first (resuming)."""
    path = _jsonl(file_path)
    skip = initial_skip
    for epoch in range(epochs):
        rng = random.Random(seed + epoch)
        buffer: list[Trajectory] = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                buffer.append(parse_row(line, f"{path.name} line {number}"))
                if len(buffer) < shuffle_buffer_size:
                    continue
                item = buffer.pop(rng.randrange(len(buffer)))
                if skip:
                    skip -= 1
                else:
                    yield item
        rng.shuffle(buffer)
        for item in buffer:
            if skip:
                skip -= 1
            else:
                yield item


def parse_row(line: str, where: str = "row") -> Trajectory:
    """One JSONL row, `{"messages": [...], "tools": [...]}`, as a Trajectory."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ArtValueError(f"{where} is not JSON: {exc}", field="file_path") from None
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise ArtValueError(f'{where} needs a "messages" list (and optionally "tools")', field="messages")
    try:
        return Trajectory(messages_and_choices=row["messages"], tools=row.get("tools"))
    except ValueError as exc:
        raise ArtValueError(f"{where}: {exc}", field="messages") from None


def create_sft_dataset_iterator(
    trajectories: list[Trajectory],
    chunk_size: int = 10,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: Schedule = "linear",
    warmup_ratio: float = 0.1,
    shuffle: bool = True,
    seed: int = 42,
    initial_step: int = 0,
    show_progress: bool = True,
) -> Iterator[SFTChunk]:
    """Chunks of `chunk_size` batches for successive `model.train_sft(chunk.trajectories,
    chunk.config)` calls (one checkpoint each), the learning rates cut from one schedule over
    every epoch. Each epoch is shuffled with `seed + epoch`, and chunks never span two epochs.
    `initial_step` (in batches) resumes at that batch: earlier chunks are skipped, and the
    chunk holding it starts there (its `step` and `epoch_step` are those of its first batch)."""
    if chunk_size < 1 or batch_size < 1 or epochs < 1:
        field = "chunk_size" if chunk_size < 1 else "batch_size" if batch_size < 1 else "epochs"
        raise ArtValueError(f"{field} must be at least 1", field=field)
    if not trajectories:
        return
    per_epoch = math.ceil(len(trajectories) / batch_size)
    total = per_epoch * epochs
    rates = create_lr_schedule(total, peak_lr, schedule_type, int(total * warmup_ratio))
    chunk_items = chunk_size * batch_size
    bar = progress_bar(
        total=total, initial=min(initial_step, total), desc="sft", unit="batch", disable=not show_progress
    )
    try:
        for epoch in range(epochs):
            order = list(trajectories)
            if shuffle:
                random.Random(seed + epoch).shuffle(order)
            for chunk_start in range(0, len(order), chunk_items):
                chunk_end = min(chunk_start + chunk_items, len(order))
                # Resuming inside this chunk drops its batches before `initial_step`.
                done = max(0, initial_step - (epoch * per_epoch + chunk_start // batch_size))
                start = min(chunk_start + done * batch_size, chunk_end)
                if start == chunk_end:
                    continue
                first = epoch * per_epoch + start // batch_size
                batches = math.ceil((chunk_end - start) / batch_size)
                config = TrainSFTConfig(learning_rate=rates[first : first + batches], batch_size=batch_size)
                yield SFTChunk(order[start:chunk_end], config, first, epoch, start // batch_size)
                bar.update(batches)
    finally:
        bar.close()


async def train_sft_from_file(
    model: TrainableModel,
    file_path: str | Path,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 2e-4,
    schedule_type: Schedule = "linear",
    warmup_ratio: float = 0.1,
    initial_step: int = 0,
    final_step: int | None = None,
    _config: dict | None = None,
    verbose: bool = False,
    shuffle_buffer_size: int = 10_000,
    log_metrics: bool = True,
    assistant_turns: AssistantTurns = "all",
) -> None:
    """SFT on a JSONL file in one `model.train_sft` call (one checkpoint): `epochs` passes in
    batches of `batch_size`, the learning rate following `schedule_type` with a warmup over
    `warmup_ratio` of the batches. `initial_step`/`final_step` (batches) train a slice of the
    run, e.g. to evaluate between slices. `assistant_turns="last"` trains only the last
    assistant message of each conversation (the earlier ones are context)."""
    rows = get_file_row_count(file_path)
    total = math.ceil(rows * epochs / batch_size)
    rates = create_lr_schedule(total, peak_lr, schedule_type, int(total * warmup_ratio))
    rates = rates[initial_step:final_step]
    if verbose:
        tqdm.write(
            f"[art] {file_path}: {rows} rows x {epochs} epochs = {total} batches of {batch_size}; "
            f"training batches {initial_step}..{initial_step + len(rates)} ({schedule_type}, peak {peak_lr:g})"
        )
    if not rates:
        return
    trajectories = list(
        itertools.islice(
            iterate_file(file_path, epochs, shuffle_buffer_size, initial_skip=initial_step * batch_size),
            len(rates) * batch_size,
        )
    )
    config = TrainSFTConfig(learning_rate=rates, batch_size=batch_size, assistant_turns=assistant_turns)
    await model.train_sft(trajectories, config, _config=_config, verbose=verbose, log_metrics=log_metrics)


def _jsonl(file_path: str | Path) -> Path:
    path = Path(file_path)
    if path.suffix != ".jsonl":
        raise ArtValueError(f"SFT data must be a .jsonl file, got {str(path)!r}", field="file_path")
    return path
