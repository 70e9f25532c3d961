"""The backend's view of a group of trainer ranks as one trainer.

`art.training.rank_group` starts the ranks, speaks to them and notices when one dies; this module
turns such a group (`RankPeers`) into a `TrainerHandle`, what the service holds, as it holds a
lone `Trainer`: `LeadTrainer` when rank 0 trains here and its peers alongside, `ShardedTrainer`
when every rank is a process (FSDP, `art.training.fsdp`) and the engine's served copy takes the
weights of each checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from art.errors import ArtError, BackendError
from art.training.options import TrainOptions
from art.training.rank_group import RankPeers
from art.training.trainer import ProgressCallback, Trainer, TrainerHandle
from art.weights import load_full_weights


class LeadTrainer(TrainerHandle):
    """Rank 0 of a data-parallel group: the backend's `Trainer` (`trainer`), whose `peers` train
    each step alongside and load each checkpoint it restores."""

    def __init__(self, trainer: Trainer, peers: RankPeers) -> None:
        self.trainer, self.peers = trainer, peers
        self.dtype = trainer.dtype
        trainer.collective = peers.collective

    @property
    def last_trainer_logprobs(self) -> list[dict]:
        """Rank 0's rows of the last step, its peers' gathered in (`Trainer.step`)."""
        return self.trainer.last_trainer_logprobs

    @last_trainer_logprobs.setter
    def last_trainer_logprobs(self, rows: list[dict]) -> None:
        self.trainer.last_trainer_logprobs = rows

    def step(
        self,
        groups,
        options: TrainOptions,
        *,
        desc: str = "train",
        on_optimizer_step: ProgressCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        quiet: bool = False,
    ) -> dict[str, float]:
        """`Trainer.step`, with the peers training the same step alongside."""
        failed = True
        try:
            self.peers.begin_step(groups, options)
            metrics = self.trainer.step(
                groups, options, desc=desc, on_optimizer_step=on_optimizer_step, should_stop=should_stop, quiet=quiet
            )
            failed = False
            return metrics
        except (ArtError, torch.cuda.OutOfMemoryError):
            raise
        except Exception as exc:  # most often a collective that lost a rank
            raise BackendError(
                f"the data-parallel step failed ({type(exc).__name__}: {exc}); it is rolled back, "
                "and ranks that died are started again before the next step"
            ) from exc
        finally:
            self.peers.end_step(failed)

    def save(self, folder: Path) -> None:
        """Rank 0 saves: every rank holds the same weights and optimizer state."""
        self.trainer.save(folder)

    def restore(self, folder: Path) -> None:
        self.trainer.restore(folder)
        self.sync_peers(folder)

    def sync_peers(self, folder: Path) -> None:
        """Every peer loads checkpoint `folder`, the one rank 0 holds (peers that died are
        started again first)."""
        self.trainer.collective = self.peers.restore(Path(folder))

    def probe_logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        """Rank 0's logprobs: its weights are every rank's."""
        return self.trainer.probe_logprobs(prompt, completion)

    def sole_trainer(self) -> None:
        return None

    def close(self) -> None:
        self.peers.close()


class ShardedTrainer(TrainerHandle):
    """The backend's handle on a sharded trainer: what `LoadedModel` asks of a trainer (step,
    save, restore, the probe's logprobs), done by the rank processes in `peers`. `model` is the
    engine's served copy; it takes the weights of each checkpoint written or restored."""

    def __init__(
        self, model, peers: RankPeers, *, lock: threading.RLock, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        self.model, self.peers, self.lock = model, peers, lock
        self.device, self.dtype = torch.device(device), dtype
        self.last_trainer_logprobs: list[dict] = []
        peers.start()  # the ranks build the base model's shards; a checkpoint is restored into them next

    def step(
        self,
        groups,
        options: TrainOptions,
        *,
        desc: str = "train",
        on_optimizer_step: ProgressCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        quiet: bool = False,
    ) -> dict[str, float]:
        metrics, self.last_trainer_logprobs = self.peers.sharded_step(groups, options, on_optimizer_step, should_stop)
        return metrics

    def save(self, folder: Path) -> None:
        self.peers.command("save", str(folder))
        self._serve(folder)

    def restore(self, folder: Path) -> None:
        self.peers.restore(Path(folder))
        self._serve(folder)

    def sync_peers(self, folder: Path) -> None:
        """The ranks already hold what they saved; only started again when they died."""
        if not self.peers.healthy:
            self.peers.restore(Path(folder))

    def probe_logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        return self.peers.command("logprobs", prompt, completion)

    def sole_trainer(self) -> None:
        return None

    def close(self) -> None:
        self.peers.close()

    def _serve(self, folder: Path) -> None:
        with self.lock:
            load_full_weights(self.model, Path(folder))
