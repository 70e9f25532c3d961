"""Ray as the cluster layer: a model's engine replicas and trainer ranks as Ray actors.

`art serve --ray [--ray-address ADDR]`, or `_internal_config={"placement": "ray"}`, puts
replicas 1..N-1 and trainer ranks 1..N-1 in Ray actors instead of local processes. Each actor
asks Ray for its CPUs, plus one GPU when the backend runs on CUDA, on whatever node Ray picks.
That is one machine after a local `ray.init()`, or many after `ray start --head` /
`--address`.

Ray places processes; torch.distributed still carries the gradients (the split verl uses).
Rank 0's TCPStore listens on this node's address, and the rank actors join it. Sharded
(`fsdp`, `art.training.fsdp`), every rank is an actor, and the backend holds the store.
The actors build their models with the same functions as the local processes (`build_engine`,
`build_trainer`) and answer in the same shape: `RayReplica` is a `CalledReplica` and `RayRanks`
a transport of `RankPeers`, so `ReplicaSet` and the trainer cannot tell them apart. Peers read
checkpoints from the backend's path (a rank's restore, a fully fine-tuned replica's weights): on
several nodes that path must be shared storage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import torch

from art.devices import process_threads, use_device
from art.engine.replica_process import (
    CalledReplica,
    ReplicaSpec,
    build_engine,
    error_payload,
    load_weights,
    revive_error,
)
from art.engine.router import ReplicaUnavailableError
from art.errors import ArtValueError, BackendError
from art.training.collective import Collective, join_default_group, start_group
from art.training.ranks import RANK_THREADS, RankSpec, RankWorker, build_trainer

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""How long an actor may take to build its model (a large one loads for minutes)."""


def ensure_ray(address: str | None = None):
    """The `ray` module, connected: to `address` (a cluster) or a local instance. Raises
    ArtValueError naming `placement` when Ray is not installed."""
    try:
        import ray
    except ImportError as exc:
        raise ArtValueError(
            "placement 'ray' needs Ray: pip install 'agent-rl-trainer[ray]'", field="placement"
        ) from exc
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray


def _gpus(device: str) -> float:
    return 1.0 if torch.device(device).type == "cuda" else 0.0


def actor_device(device: str) -> str:
    """An actor's device: the CPU, or on CUDA the one GPU Ray gave it (`num_gpus=1` leaves it the
    only visible one: cuda:0)."""
    return "cuda:0" if torch.device(device).type == "cuda" else device


# -- engine replicas -----------------------------------------------------------------------


class ReplicaActor:
    """Runs in a Ray worker: one replica's engine; every answer is ("ok", value) or ("error", payload)."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        device = actor_device(spec.engine.device)
        use_device(device)
        torch.set_num_threads(spec.threads)
        self.engine = build_engine(spec, device)

    def ready(self) -> int:
        return os.getpid()

    async def generate(self, prompt, params, adapter):
        try:
            return "ok", await self.engine.generate(prompt, params, adapter)
        except Exception as exc:
            return "error", error_payload(exc)

    async def load(self, step: int, weights):
        try:
            await asyncio.to_thread(load_weights, self.engine, step, weights)
            return "ok", None
        except Exception as exc:
            return "error", error_payload(exc)


class RayReplica(CalledReplica):
    """A replica in a Ray actor: the same face as `ProcessReplica`."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        self.index, self.spec = index, spec
        self.down = "not started"
        self.actor: Any = None  # a Ray actor handle
        self.pid: int | None = None

    def start(self) -> None:
        """Create the actor and wait until its engine is built (blocking)."""
        ray = ensure_ray()
        self.close()
        actor_class = ray.remote(ReplicaActor)
        self.actor = actor_class.options(
            num_cpus=self.spec.threads, num_gpus=_gpus(self.spec.engine.device), max_concurrency=1024, name=None
        ).remote(self.index, self.spec)
        try:
            self.pid = ray.get(self.actor.ready.remote(), timeout=START_TIMEOUT_S)
        except Exception as exc:
            self.close()
            raise BackendError(f"replica {self.index} could not start in Ray: {exc}") from exc
        self.down, self.step = None, 0

    def mark_down(self, reason: str) -> None:
        if self.down is None:
            log.error("replica %d leaves the rotation: %s", self.index, reason)
        self.down = reason

    async def call(self, method: str, *args):
        import ray

        if self.down is not None:
            raise ReplicaUnavailableError(f"replica {self.index} is out of rotation: {self.down}")
        try:
            kind, detail = await getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            self.mark_down(f"its Ray actor died ({type(exc).__name__})")
            raise ReplicaUnavailableError(
                f"replica {self.index} stopped while serving this request; send it again: the other replicas serve"
            ) from None
        if kind != "ok":
            raise revive_error(detail, self.index)
        return detail

    def close(self) -> None:
        if self.actor is not None:
            import ray

            ray.kill(self.actor)
        self.actor = self.pid = None
        self.down = self.down or "closed"


# -- trainer ranks -------------------------------------------------------------------------


class RankActor:
    """Runs in a Ray worker: one trainer rank (rank >= 1, or sharded any rank) and its model."""

    def __init__(self, rank: int, world: int, spec: RankSpec) -> None:
        self.device = torch.device(actor_device(spec.device))
        use_device(str(self.device))
        torch.set_num_threads(process_threads(RANK_THREADS))
        self.rank, self.world, self.spec = rank, world, spec
        self.worker: RankWorker | None = None
        self._answers: list = []

    def join(self, host: str, port: int):
        """Join the group, then build the model (returns once both are done)."""
        try:
            join = join_default_group if self.spec.sharded else start_group
            collective = join(self.rank, self.world, self.device, port=port, host=host)
            self.worker = RankWorker(build_trainer(self.spec, collective), self.rank, self._answers.append)
            return "ok", os.getpid()
        except Exception as exc:
            return "error", f"rank {self.rank} could not start: {type(exc).__name__}: {exc}"

    def command(self, name: str, *args) -> list:
        """Run one command as a local peer does (`RankWorker.call`); every answer it gave,
        progress events first (they reach the backend when the command is done)."""
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank} is not started")
        self._answers.clear()
        self.worker.call(name, *args)
        return list(self._answers)


class RayRanks:
    """Ranks 1..N-1 (sharded: all N) as Ray actors: a transport of `RankPeers`
    (`RankPeers(world, spec, RayRanks)`), as `ProcessRanks` is for local processes."""

    def __init__(self, world: int, spec: RankSpec, first: int) -> None:
        self.world, self.spec, self.first = world, spec, first
        self.actors: list = []
        self._refs: list = []
        self.pids: list[int] = []

    def host(self) -> str:
        """This node's address, where the group's store listens for the actors."""
        return ensure_ray().util.get_node_ip_address()

    def start(self, store, join) -> Collective | None:
        """Create the rank actors and let them join the group on `store`, rank 0 with `join()`
        (None when sharded) meanwhile; returns what `join` returned, once every rank is ready."""
        ray = ensure_ray()
        host = ray.util.get_node_ip_address()
        actor_class = ray.remote(RankActor)
        self.actors = [
            actor_class.options(num_cpus=1, num_gpus=_gpus(self.spec.device)).remote(rank, self.world, self.spec)
            for rank in range(self.first, self.world)
        ]
        joins = [actor.join.remote(host, store.port) for actor in self.actors]
        collective = join() if join is not None else None
        answers = ray.get(joins, timeout=START_TIMEOUT_S)
        failed = [detail for kind, detail in answers if kind != "ok"]
        if failed:
            self.close()
            raise BackendError(f"trainer ranks could not start in Ray: {failed[0]}")
        self.pids = [pid for _, pid in answers]
        return collective

    def alive(self) -> bool:
        return bool(self.actors)

    def dead(self) -> tuple[int, None] | None:
        """(rank, None) of an actor that died during the running command, or None (the
        `PeerWatcher` asks during a step)."""
        import ray

        refs = list(self._refs)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return refs.index(ref) + self.first, None
            except Exception:  # an answer, not a death: `replies` reads it
                pass
        return None

    def send(self, *message) -> None:
        self._refs = [actor.command.remote(*message) for actor in self.actors]

    def replies(self, what: str, deadline: float, on_progress=None, poll=None) -> list:
        """Each actor's reply to the last command, in rank order: its (kind, detail), or the
        BackendError of a rank that died or did not answer by `deadline`. An actor that died
        ends the wait for the others: they may wait for it in a collective for ever."""
        import ray

        pending, died = list(self._refs), None
        while pending and died is None and time.monotonic() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.2)
            if poll is not None:
                poll()
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    died = self._refs.index(ref) + self.first
        out: list = []
        for rank, ref in enumerate(self._refs, start=self.first):
            if ref in pending:
                out.append(
                    BackendError(
                        f"trainer rank {died} died during {what}"
                        if died is not None
                        else f"trainer rank {rank} did not answer {what} in time"
                    )
                )
                continue
            try:
                *progress, answer = ray.get(ref)
            except ray.exceptions.RayActorError:
                out.append(BackendError(f"trainer rank {rank} died during {what}"))
                continue
            for _, event in progress:
                if on_progress is not None:
                    on_progress(*event)
            out.append(answer)
        self._refs = []
        return out

    def close(self) -> None:
        if self.actors:
            import ray

            for actor in self.actors:
                ray.kill(actor)
        self.actors, self._refs = [], []
