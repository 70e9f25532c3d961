"""What the engine (`art.engine.llm_engine`) asks of the runner that does its tensor work.

Two runners implement it: `art.engine.static_runner.StaticRunner` (the engine's own decoder,
static shapes, CUDA graphs) and `art.engine.hf_runner.HFRunner` (transformers' forward). A
prefill hands back the prompts it computed in the runner's own form (`StagedT`); the engine
never looks inside, it only hands them back to the same runner (`prompt_kv`, `add`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from art.engine.prefix_cache import KV

StagedT = TypeVar("StagedT")
"""The prompts a runner's prefill computed, in that runner's form."""


class Runner(Protocol[StagedT]):
    """A running batch of rows (row i: the engine's `rows[i]`) and the forward passes over it."""

    max_rows: int
    """Rows the batch may hold at most (the scheduler's `max_num_seqs`)."""
    prefill_computed_tokens: int
    """Prompt tokens actually run through the model (the rest came from cached prefixes)."""

    @property
    def row_width(self) -> Callable[[int], int] | None:
        """For a fixed KV layout, the positions a row of a given final length holds; None when
        the KV budget is a plain sum of lengths."""
        ...

    @property
    def kv_positions(self) -> int:
        """KV positions of a fixed layout (the scheduler's budget then)."""
        ...

    @property
    def prefixes_whole(self) -> bool:
        """Whether a cached prompt (`prompt_kv`) serves only a prompt that continues the whole of
        it (a recurrent state is the one its end left: `prefix_cache.StateAtEnd`), not any prefix."""
        ...

    @property
    def serves_while_training(self) -> bool:
        """Whether it reads only its own copies of the live weights, so a training step may run beside it."""
        ...

    def prefill(
        self, prompts: list[list[int]], prefixes: list[tuple[int, KV | None]], adapter_names: list[str]
    ) -> tuple[torch.Tensor, StagedT]:
        """Run each prompt after its cached prefix: (last logits [prompts, vocab], the staged prompts)."""
        ...

    def prompt_kv(self, staged: StagedT, index: int) -> KV:
        """Staged prompt `index`'s keys and values, for the prefix cache."""
        ...

    def add(self, staged: StagedT, sources: list[int], ends: list[int] | None = None) -> None:
        """Append one row per entry of `sources`, a copy of that staged prompt; `ends[k]`: the length it may reach."""
        ...

    def decode(self, tokens: list[int], positions: list[int], adapter_names: list[str]) -> torch.Tensor:
        """One token for every running row at its position: logits [rows, vocab]."""
        ...

    def keep(self, order: list[int]) -> None:
        """Keep only the rows `order` names, row order[i] now in slot i."""
        ...

    def clear(self) -> None:
        """Forget every row (after a failure or a stop)."""
        ...

    def idle(self) -> None:
        """No rows are running (a training step is about to start): free what it can."""
        ...

    def weights_changed(self, *, all_weights: bool, retire: str | None = None) -> None:
        """The live weights changed (all of them, or the adapter); `retire`: keep the old copies under that name."""
        ...

    def refresh(self) -> None:
        """Copy the published weights now (the trainer is about to write the live ones)."""
        ...

    def retired(self) -> set[str]:
        """Names of earlier publications whose copies it still keeps."""
        ...

    def forget(self, name: str) -> None:
        """Drop the copies kept under a retired name."""
        ...

    def stats(self) -> dict[str, float]:
        """Its part of the engine's /health stats."""
        ...
