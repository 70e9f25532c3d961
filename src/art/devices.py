"""Where a process of ours runs: one GPU per engine replica or trainer rank, and its threads.

Replicas (`art.engine.replicas`) and trainer ranks (`art.training.ranks`) place their processes
the same way, and neither may import the other, so the rule lives here, below both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from art.errors import ArtValueError

_ONE_PER_GPU = {"engine_replicas": "replica", "trainer_ranks": "rank"}
"""The config field that counts a kind of process, and what one of them is called."""


def device_for(device: str, index: int, gpus: int, field: str) -> str:
    """Process `index`'s device: the CPU, or on CUDA a GPU of its own out of `gpus`, counted on
    from `device`'s (index 0 on `device`, the next ones after it, wrapping past the last GPU onto
    the first). Raises ArtValueError naming `field` ("engine_replicas" or "trainer_ranks") when
    there is no GPU left for it: two replicas on one GPU would each size their KV cache from what
    the other left free, and the second would not fit."""
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return device
    if index >= gpus:
        unit = _ONE_PER_GPU[field]
        raise ArtValueError(
            f"{field}={index + 1} needs a GPU per {unit}; this machine has {gpus} "
            f"(placement 'ray' spreads {unit}s over a cluster)",
            field=field,
        )
    return f"cuda:{((parsed.index or 0) + index) % gpus}"


def local_gpus(device: str) -> int:
    """How many GPUs this machine has for processes on `device` (0 off CUDA)."""
    return torch.cuda.device_count() if torch.device(device).type == "cuda" else 0


def use_device(device: str) -> None:
    """Make a CUDA `device` this process's current one (first thing in a replica or a rank: its
    CUDA context, streams and graph captures then land on its own GPU, not on GPU 0)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))


def process_threads(variable: str) -> int:
    """torch threads per CPU process, from the environment `variable` (`ART_REPLICA_THREADS`,
    `ART_RANK_THREADS`; default 1)."""
    return max(1, int(os.environ.get(variable, "1")))


def cpu_split(device: str, training_threads: int | None) -> tuple[int, int] | None:
    """(engine threads, trainer threads) while a training step runs beside the engine on the
    CPU: the trainer's `training_threads` (default half the cores), the engine the rest, each
    at least one. None on CUDA, where they share the GPU, not cores."""
    if torch.device(device).type != "cpu":
        return None
    total = torch.get_num_threads()
    trainer = training_threads or max(1, total - max(1, total // 2))
    return max(1, total - trainer), trainer


@contextmanager
def thread_count(threads: int | None) -> Iterator[None]:
    """This thread's torch threads inside the block (None: unchanged). Under OpenMP the count is
    per thread, so another thread's (the engine's) is not touched."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
