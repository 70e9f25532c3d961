"""Data-parallel training on torch.distributed: the processes that hold the trainer ranks.

Rank 0 is the trainer inside the backend (it shares its model with the engine). Ranks
1..N-1 are processes started by `art.training.rank_group.RankPeers` (or, on a cluster, by Ray:
`art.ray_cluster`). Each holds its own copy of the model and runs commands sent over a pipe
(`RankWorker`): restore a checkpoint folder, train a step, close. The process group
(`art.training.collective`) carries only the tensors of a step. Sharded (`art.training.fsdp`,
FSDP2), every rank is such a process and also saves and scores.

This module is what runs in those processes; the backend's side of them (starting them,
sending commands, watching for a dead rank) is `art.training.rank_group`'s, and its trainer
handles over a group (`LeadTrainer`, `ShardedTrainer`) are `art.training.rank_trainers`'.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import art.base_models
from art.devices import device_for, local_gpus, process_threads, use_device
from art.errors import ArtValueError, StepCancelledError, to_wire
from art.training.collective import Collective, join_default_group, start_group
from art.training.fsdp import mixed_precision, shard_model
from art.training.options import TrainOptions
from art.training.trainer import ProgressCallback, Trainer

log = logging.getLogger(__name__)

RANK_THREADS = "ART_RANK_THREADS"
"""The environment variable of torch threads per CPU peer (`art.devices.process_threads`)."""


@dataclass(frozen=True)
class RankSpec:
    """What a peer needs to build the same trainable model as rank 0."""

    base_model: str
    lora: dict | None
    """peft LoraConfig arguments; None for full fine-tuning."""
    device: str
    dtype: str
    """torch dtype name of the compute precision (e.g. "float32", "bfloat16")."""
    sharded: bool = False
    """FSDP2 over every rank (`art.training.fsdp`); full fine-tuning only."""


def build_trainer(spec: RankSpec, collective: Collective) -> Trainer:
    """A rank's model and Trainer, built the way `art.service.build` builds rank 0's."""
    dtype, device = getattr(torch, spec.dtype), collective.device
    model, tokenizer = art.base_models.load_policy(spec.base_model, spec.lora, dtype=dtype, device=device)
    gather = shard_model(model, device, dtype) if spec.sharded else None
    trainer = Trainer(
        model,
        tokenizer,
        device=device,
        dtype=dtype,
        collective=collective,
        gather=gather,
        load_reference=art.base_models.reference_loader(spec.base_model, spec.lora, dtype=dtype, device=device),
    )
    if spec.sharded and mixed_precision(dtype).param_dtype is not None:
        trainer.autocast = False  # FSDP2 gathers the weights in `dtype` already
    return trainer


def peer_main(rank: int, world: int, port: int, spec: RankSpec, connection) -> None:
    """A peer process: join the group, build the model, then run the backend's commands."""
    device = device_for(spec.device, rank, local_gpus(spec.device), "trainer_ranks")
    use_device(device)  # first: the CUDA context, NCCL's streams and every kernel on this rank's GPU
    torch.set_num_threads(process_threads(RANK_THREADS))
    collective = (join_default_group if spec.sharded else start_group)(rank, world, torch.device(device), port=port)
    try:
        worker = RankWorker(build_trainer(spec, collective), rank, connection.send)
    except BaseException as exc:
        connection.send(("error", f"rank {rank} could not build its model: {type(exc).__name__}: {exc}"))
        return
    connection.send(("ready", None))
    while True:
        command, *args = connection.recv()
        if command == "close":
            return
        worker.call(command, *args)


class RankWorker:
    """A peer's trainer and the backend's commands, one method each; `answer` takes ("ok",
    result) or ("error", detail) for each command, and rank 0's ("progress", ...) events."""

    COMMANDS = frozenset({"restore", "save", "logprobs", "step"})
    """What the backend may ask (`call`)."""

    def __init__(self, trainer: Trainer, rank: int, answer: Callable[[tuple[str, object]], None]) -> None:
        self.trainer, self.rank, self.answer = trainer, rank, answer

    def call(self, name: str, *args) -> None:
        """Run command `name` and answer it. A failure every rank shares (a cancel, a diverged
        step) is answered in its wire form (`art.errors.to_wire`); one of the peer's own is
        answered as text with its traceback and also ends its process, so the ranks waiting on it
        in a collective fail at once instead of at the timeout."""
        try:
            if name not in self.COMMANDS:
                raise ValueError(f"unknown trainer rank command {name!r}")
            self.answer(("ok", getattr(self, name)(*args)))
        except (StepCancelledError, ArtValueError) as exc:  # raised on every rank alike
            self.answer(("error", to_wire(exc)))
        except BaseException as exc:
            log.error("trainer rank %d failed; its process ends", self.rank, exc_info=True)
            self.answer(("error", f"rank {self.rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            os._exit(1)

    def restore(self, folder: str) -> None:
        self.trainer.restore(Path(folder))

    def save(self, folder: str) -> None:
        self.trainer.save(Path(folder))

    def logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        """The weight-sync probe's trainer side (`Trainer.probe_logprobs`)."""
        return self.trainer.probe_logprobs(prompt, completion)

    def step(self, groups, options: TrainOptions) -> tuple[dict[str, float], list[dict]] | None:
        """One training step; rank 0 (a peer only when sharded) returns (metrics, trainer logprob
        rows) and sends ("progress", (done, total, metrics)) after each optimizer step."""
        progress: ProgressCallback | None = None if self.rank else (lambda *event: self.answer(("progress", event)))
        metrics = self.trainer.step(
            groups,
            options,
            desc=f"rank {self.rank}",
            quiet=True,
            on_optimizer_step=progress,
            should_stop=self.trainer.collective.stop_requested,
        )
        return None if self.rank else (metrics, self.trainer.last_trainer_logprobs)
