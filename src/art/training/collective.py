"""One rank's view of the training group: the tensors and small values the ranks exchange.

Every rank holds the same weights and optimizer state and receives the same groups. Each
mini-batch is split into per-rank shards (`Collective.shard`: whole groups, balanced by
tokens). Each rank runs its shard's micro-batches, with the loss still normalised by the
*whole* mini-batch (`Normalizer`). The gradients are then summed across ranks (one flat
all-reduce per optimizer step), which gives exactly the single-process gradient up to float
summation order, and every rank applies the same clipped AdamW step. gloo on CPU, NCCL on CUDA.
The processes that hold the ranks are `art.training.ranks`'s.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from art.training.sequences import Sequence

log = logging.getLogger(__name__)

STEP_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective waits for a slow rank before the step fails (and rolls back)."""
STOP_KEY = "art/stop"
"""Set in the group's store to cancel the running step (sharded ranks have no rank 0 in the
backend to decide it); deleted when a step begins."""


class Collective:
    """One rank's view of the training group. `world == 1` (no group) is the single process."""

    def __init__(
        self,
        rank: int = 0,
        world: int = 1,
        group=None,
        store=None,
        device: str | torch.device = "cpu",
        sharded: bool = False,
    ) -> None:
        self.rank, self.world, self.group, self.store = rank, world, group, store
        self.device = torch.device(device)
        """Where the group's tensors live (NCCL needs them on the rank's GPU)."""
        self.sharded = sharded
        """The model is FSDP2-sharded over the group (`art.training.fsdp`): its backward
        already sums the gradients, and every rank must run as many passes as the others."""
        self._rounds = 0
        self.lost: str | None = None
        """Why this rank no longer waits on the group (a peer died: `abandon`); None while sound."""

    def abandon(self, reason: str) -> None:
        """End this rank's waits on the group: each raises PeerLost with `reason` (called by the
        `PeerWatcher`'s thread when a peer died). An NCCL group is also aborted, which frees the
        kernel waiting on the GPU for the dead rank; gloo's `abort` leaves a pending wait as it is
        (torch 2.13), so there the watched wait alone ends it."""
        self.lost = reason
        abort = getattr(self.group, "abort", None)
        if self.device.type == "cuda" and abort is not None:
            try:
                abort()
            except Exception:  # the wait raises all the same
                log.warning("aborting the trainer group failed", exc_info=True)

    def _wait(self, work) -> None:
        """Wait for a collective to finish, unless the group is abandoned. (NCCL's own `wait` only
        orders streams: the host would block later, in `.item()`, for ever if a peer died.)"""
        pause = 1e-4
        while not work.is_completed() and self.lost is None:
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        if self.lost is not None:  # an aborted NCCL collective may complete, with garbage
            raise PeerLost(self.lost)
        work.wait()

    def _get(self, key: str) -> bytes:
        """A store value another rank sets, unless the group is abandoned first (or STEP_TIMEOUT)."""
        pause, deadline = 1e-4, time.monotonic() + STEP_TIMEOUT.total_seconds()
        while not self.store.check([key]):
            if self.lost is not None:
                raise PeerLost(self.lost)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rank set {key} within {STEP_TIMEOUT}")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return self.store.get(key)

    def shard(self, part: list[Sequence]) -> list[Sequence]:
        """This rank's sequences of a mini-batch: whole groups, assigned longest first to the
        least-loaded rank (by tokens); single sequences when there are fewer groups than ranks.
        Deterministic, so every rank computes the same assignment."""
        if self.world == 1:
            return part
        groups: dict[int, list[Sequence]] = {}
        for s in part:
            groups.setdefault(s.group, []).append(s)
        units = list(groups.values()) if len(groups) >= self.world else [[s] for s in part]
        load = [0] * self.world
        mine: list[Sequence] = []
        for unit in sorted(units, key=lambda u: -sum(len(s.token_ids) for s in u)):  # stable: ties keep order
            rank = load.index(min(load))
            load[rank] += sum(len(s.token_ids) for s in unit)
            if rank == self.rank:
                mine += unit
        return sorted(mine, key=lambda s: s.group)

    def stop_requested(self) -> bool:
        """Whether the backend asked, through the store, to cancel the running step."""
        return self.store is not None and self.store.check([STOP_KEY])

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any (a cancel seen by one rank stops all)."""
        if self.world == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        self._wait(self.group.allreduce([value]))
        return bool(value.item())

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every trained parameter's gradient across ranks, in one flat buffer (a rank
        whose shard was empty contributes zeros). Sharded, FSDP has summed them already."""
        if self.world == 1 or self.sharded:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self._wait(self.group.allreduce([flat]))
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def sum_values(self, values: Mapping[str, float]) -> dict[str, float]:
        """Per-rank sums (loss terms, token counts) summed across ranks; every rank gets them."""
        if self.world == 1:
            return dict(values)
        total: dict[str, float] = {}
        for part in self.gather(dict(values)):
            for key, value in part.items():
                total[key] = total.get(key, 0) + value
        return total

    def gather(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank (small Python objects, through the
        group's store; each call has keys of its own)."""
        if self.world == 1:
            return [value]
        self._rounds += 1
        self.store.set(f"gather/{self._rounds}/{self.rank}", pickle.dumps(value))
        return [pickle.loads(self._get(f"gather/{self._rounds}/{rank}")) for rank in range(self.world)]


def host_store(world: int, host: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (`store.port` tells the peers where)."""
    return dist.TCPStore(host, 0, world, True, timeout=STEP_TIMEOUT, wait_for_workers=False)


def start_group(
    rank: int,
    world: int,
    device: torch.device,
    *,
    store: dist.TCPStore | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
) -> Collective:
    """Join a process group of `world` ranks (rank 0 passes its `store`, the others its
    `port`): gloo on CPU, NCCL on CUDA. A group object of its own, not torch's default group,
    so one process may hold several models' groups. Returns once every rank has joined."""
    if store is None:
        if port is None:
            raise ValueError(f"rank {rank} joins the group at rank 0's store: give its port (or the store)")
        store = dist.TCPStore(host, port, world, False, timeout=STEP_TIMEOUT)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = STEP_TIMEOUT  # NCCL's default is 10 minutes, after which its watchdog ends the process
        return Collective(rank, world, dist.ProcessGroupNCCL(store, rank, world, options), store, device)
    return Collective(rank, world, dist.ProcessGroupGloo(store, rank, world, STEP_TIMEOUT), store, device)


def join_default_group(rank: int, world: int, device: torch.device, port: int, host: str = "127.0.0.1") -> Collective:
    """A sharded rank's group: torch's default group (what FSDP2 runs on), one per process."""
    store = dist.TCPStore(host, port, world + 1, False, timeout=STEP_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=STEP_TIMEOUT)
    return Collective(rank, world, dist.distributed_c10d._get_default_group(), store, device, sharded=True)


class PeerLost(RuntimeError):
    """A wait of rank 0 on the group ended because a peer died (`Collective.abandon`); the step
    fails like a broken collective, and is rolled back."""
