"""The backend's side of a group of trainer ranks: starting them, commanding them, noticing a dead one.

`RankPeers` starts the peer ranks through a `RankTransport` (`ProcessRanks`: local processes
over pipes; `art.ray_cluster.RayRanks`: Ray actors), sends them each command and reads their
answers. A failed step is rolled back by the backend; if a rank died (or a collective broke),
the next restore starts every peer again, so the following step trains cleanly. Rank 0 waits
for its peers only in `Collective`'s watched waits: while a step runs, a `PeerWatcher` thread
polls the peers and, when one dies, ends those waits (and aborts an NCCL group), so the step
fails at once and rolls back instead of hanging in a collective (gloo notices a closed socket
by itself, NCCL does not notice at all).

This module is the group's transport and lifecycle; the backend holds a group as one trainer
through `art.training.rank_trainers` (`LeadTrainer`, `ShardedTrainer`), and what runs inside a
rank process is `art.training.ranks`.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from art.devices import device_for, local_gpus
from art.errors import ArtValueError, BackendError, StepCancelledError, from_wire
from art.training.collective import STEP_TIMEOUT, STOP_KEY, Collective, host_store, start_group
from art.training.ranks import RankSpec, peer_main
from art.training.trainer import ProgressCallback

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
"""How often the `PeerWatcher` looks at the peers during a step."""

Reply = tuple[str, object] | BackendError
"""A rank's reply to a command: its (kind, detail), or the error of a rank that died or did not answer."""


class RankTransport(Protocol):
    """What reaches the peer ranks for `RankPeers`: it starts them, sends them a command,
    collects their replies, and says which one died. `ProcessRanks` and
    `art.ray_cluster.RayRanks` implement it; `RankPeers` builds one as
    `transport(world, spec, first)`."""

    def host(self) -> str:
        """Where the group's store listens."""
        ...

    def start(self, store: dist.TCPStore, join: Callable[[], Collective] | None) -> Collective | None:
        """Start ranks `first`..`world-1` on `store` (rank 0 runs `join()` meanwhile); what `join` returned."""
        ...

    def alive(self) -> bool:
        """Whether every rank it started still runs."""
        ...

    def dead(self) -> tuple[int, int | None] | None:
        """(rank, exit code or None) of a rank that ended, or None while all live."""
        ...

    def send(self, *message) -> None:
        """Send one command to every rank."""
        ...

    def replies(
        self,
        what: str,
        deadline: float,
        on_progress: ProgressCallback | None = None,
        poll: Callable[[], None] | None = None,
    ) -> list[Reply]:
        """Each rank's reply to the last command, in rank order (`poll()` runs while it waits)."""
        ...

    def close(self) -> None:
        """End every rank it started."""
        ...


class ProcessRanks(RankTransport):
    """The ranks as local processes, spoken to over pipes: how `RankPeers` reaches them by
    default (`art.ray_cluster.RayRanks` reaches Ray actors instead)."""

    def __init__(self, world: int, spec: RankSpec, first: int) -> None:
        self.world, self.spec, self.first = world, spec, first
        self.processes: list = []
        self._connections: list = []

    def host(self) -> str:
        """Where the group's store listens."""
        return "127.0.0.1"

    def start(self, store: dist.TCPStore, join: Callable[[], Collective] | None) -> Collective | None:
        """Start ranks `first`..`world-1` on `store`; `join()` (None when sharded) makes rank 0
        join the group meanwhile. Returns what `join` returned, once every rank is ready."""
        device_for(self.spec.device, self.world - 1, local_gpus(self.spec.device), "trainer_ranks")
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or CUDA state
        for rank in range(self.first, self.world):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=peer_main,
                args=(rank, self.world, store.port, self.spec, theirs),
                name=f"art-trainer-rank-{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)
            self._connections.append(ours)
        collective = self._join_watching(join) if join is not None else None
        _, error, _ = read_replies(
            self.replies("start", time.monotonic() + STEP_TIMEOUT.total_seconds()), "ready", "start", self.first
        )
        if error is not None:
            raise error
        return collective

    def _join_watching(self, join: Callable[[], Collective]) -> Collective:
        """Rank 0 joins the group while its peers are watched: a peer that ends before joining
        would leave the rendezvous waiting for it until STEP_TIMEOUT. (The join, which cannot be
        interrupted, is then left to time out on its thread.)"""
        joined: dict = {}

        def run() -> None:
            try:
                joined["collective"] = join()
            except BaseException as exc:  # raised on the caller's thread below
                joined["error"] = exc

        thread = threading.Thread(target=run, name="art-trainer-rank-0-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = self.dead()
            if dead is not None and thread.is_alive():
                raise BackendError(
                    f"trainer rank {dead[0]} ended (exit code {dead[1]}) before joining the group; "
                    "its error is in the output above"
                )
        if "error" in joined:
            raise joined["error"]
        return joined["collective"]

    def alive(self) -> bool:
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def dead(self) -> tuple[int, int | None] | None:
        """(rank, exit code) of a peer process that ended, or None while all live."""
        return next(
            ((rank, p.exitcode) for rank, p in enumerate(self.processes, start=self.first) if p.exitcode is not None),
            None,
        )

    def send(self, *message) -> None:
        for rank, connection in enumerate(self._connections, start=self.first):
            try:
                connection.send(message)
            except OSError as exc:
                raise BackendError(
                    f"trainer rank {rank} is gone ({type(exc).__name__}); the ranks are started "
                    "again at the next restore"
                ) from exc

    def replies(
        self,
        what: str,
        deadline: float,
        on_progress: ProgressCallback | None = None,
        poll: Callable[[], None] | None = None,
    ) -> list[Reply]:
        """Each rank's reply to the last command, in rank order: its (kind, detail), or the
        BackendError of a rank that died or did not answer by `deadline`. `poll()` runs meanwhile."""
        out: list[Reply] = []
        for rank, (process, connection) in enumerate(zip(self.processes, self._connections), start=self.first):
            try:
                out.append(self._receive(connection, deadline, on_progress, poll))
            except TimeoutError:
                out.append(BackendError(f"trainer rank {rank} did not answer {what} in time"))
            except PeerDied as died:  # this rank may wait for the dead one in a collective for ever
                out.append(BackendError(f"trainer rank {died.args[0]} died during {what} (exit code {died.args[1]})"))
            except (EOFError, OSError):
                out.append(BackendError(f"trainer rank {rank} died during {what} (exit code {process.exitcode})"))
        return out

    def _receive(self, connection, deadline: float, on_progress, poll) -> tuple[str, object]:
        """The next answer on `connection`, passing progress events on and running `poll`.
        Raises PeerDied when another peer's process ended meanwhile: this one may be waiting for
        it in a collective (the store's waits do not notice a dead rank), so it is not waited for."""
        while True:
            if poll is not None:
                poll()
            if not connection.poll(max(0.0, min(0.2, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError
                dead = self.dead()
                if dead is not None and not connection.poll(1.0):  # a last chance to answer its own error
                    raise PeerDied(*dead)
                continue
            kind, detail = connection.recv()
            if kind != "progress":
                return kind, detail
            if on_progress is not None:
                on_progress(*detail)

    def close(self) -> None:
        for connection in self._connections:
            try:
                connection.send(("close",))
            except (OSError, BrokenPipeError):
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes, self._connections = [], []


class RankPeers:
    """The backend's handle on the trainer ranks it runs as processes: ranks 1..N-1, which train
    in step with rank 0 (the backend's own trainer), or, sharded, all N. `transport` builds
    what reaches them: `ProcessRanks` (default) or `art.ray_cluster.RayRanks`."""

    def __init__(
        self, world: int, spec: RankSpec, transport: Callable[[int, RankSpec, int], RankTransport] | None = None
    ) -> None:
        if world < 2 and not spec.sharded:
            raise ArtValueError(f"trainer_ranks must be at least 2 to start peers, got {world}", field="trainer_ranks")
        self.world, self.spec = world, spec
        self.first = 0 if spec.sharded else 1
        """The lowest rank run as a peer."""
        self.transport = (transport or ProcessRanks)(world, spec, self.first)
        self.collective = Collective()
        self._store: dist.TCPStore | None = None  # the group's store (rank 0's, or sharded the backend's)
        self._watcher: PeerWatcher | None = None
        self.healthy = False

    def start(self) -> Collective:
        """(Re)start every peer and the group; returns rank 0's new collective."""
        self.close()
        host = self.transport.host()
        self._store = store = host_store(self.world + (self.first == 0), host)  # sharded: the backend holds it, no rank
        join = (lambda: start_group(0, self.world, torch.device(self.spec.device), store=store)) if self.first else None
        self.collective = self.transport.start(store, join) or self.collective
        self.healthy = True
        log.info("trainer ranks %d-%d started%s", self.first, self.world - 1, " (sharded)" if self.spec.sharded else "")
        return self.collective

    def restore(self, folder: Path) -> Collective:
        """Every peer loads the checkpoint rank 0 restored; peers that died (or a broken group)
        are started again first."""
        if not self.healthy or not self.transport.alive():
            self.start()
        self._send("restore", str(folder))
        self._answers("ok", what="restore")
        return self.collective

    def begin_step(self, groups, options) -> None:
        if not self.healthy:
            raise BackendError("the trainer ranks are not running (a failed step?); restore a checkpoint first")
        self._running_store().delete_key(STOP_KEY)
        self._send("step", list(groups), options)
        if self.first:  # rank 0 trains here, waiting for the peers in collectives: watch them meanwhile
            self._watcher = PeerWatcher(self.collective, self.transport.dead)

    def end_step(self, failed: bool, on_progress=None, should_stop=None) -> list:
        """Wait for every peer's step and return their results; raise the first error (or mark
        the group broken when rank 0 itself failed, since its peers may be stuck in a
        collective). `on_progress` gets rank 0's progress events; `should_stop` is polled
        meanwhile and, once True, cancels the step on every peer."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        try:
            return self._answers(
                "ok", what="step", timeout=5.0 if failed else None, on_progress=on_progress, should_stop=should_stop
            )
        except BackendError:
            self.healthy = False
            if not failed:
                raise
        except (StepCancelledError, ArtValueError):
            if not failed:
                raise
        return []

    def sharded_step(self, groups, options, on_progress=None, should_stop=None) -> tuple[dict, list]:
        """Sharded: one step on every rank; rank 0's (metrics, trainer logprob rows)."""
        self.begin_step(groups, options)
        try:
            return self.end_step(False, on_progress, should_stop)[0]
        except (ArtValueError, StepCancelledError):
            raise
        except BackendError as exc:
            raise BackendError(
                f"{exc}; the step is rolled back, and ranks that died are started again before the next step"
            ) from exc

    def command(self, name: str, *args):
        """Sharded: run "save" or "logprobs" on every rank; rank 0's result."""
        if not self.healthy:
            raise BackendError("the trainer ranks are not running (a failed step?); restore a checkpoint first")
        self._send(name, *args)
        return self._answers("ok", what=name)[0]

    def _running_store(self) -> dist.TCPStore:
        """The group's store, which exists while the ranks run (`start` to `close`)."""
        if self._store is None:
            raise BackendError("the trainer ranks are not running; restore a checkpoint first")
        return self._store

    def _send(self, *message) -> None:
        try:
            self.transport.send(*message)
        except BackendError:
            self.healthy = False
            raise

    def _answers(
        self, expected: str, *, what: str, timeout: float | None = None, on_progress=None, should_stop=None
    ) -> list:
        """Each peer's answer, in rank order (raises the first error once all answered)."""

        def poll() -> None:
            if should_stop is not None and should_stop():
                self._running_store().set(STOP_KEY, "1")

        deadline = time.monotonic() + (timeout if timeout is not None else STEP_TIMEOUT.total_seconds())
        results, error, broken = read_replies(
            self.transport.replies(what, deadline, on_progress, poll), expected, what, self.first
        )
        if broken:
            self.healthy = False
        if error is not None:
            raise error
        return results

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self.transport.close()
        self._store = None
        self.collective = Collective()
        self.healthy = False


class PeerWatcher:
    """During a step, a thread that polls `dead()` (a dead peer's (rank, exit code or None), or
    None) every WATCH_INTERVAL_S and, when a peer died, abandons `collective`: rank 0's waits
    on the group then fail at once. `stop()` ends it; it never fires while every peer lives."""

    def __init__(self, collective: Collective, dead) -> None:
        self.collective, self.dead = collective, dead
        self.fired: str | None = None
        """The reason it abandoned the group, or None."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="art-trainer-peer-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            dead = self.dead()
            if dead is not None:
                rank, code = dead
                self.fired = f"trainer rank {rank} died" + (f" (exit code {code})" if code is not None else "")
                log.error("%s during the step; rank 0 stops waiting for it", self.fired)
                self.collective.abandon(self.fired)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class PeerDied(Exception):
    """(rank, exit code) of a peer process that ended while the others were being waited for."""


def read_replies(replies: list, expected: str, what: str, first: int) -> tuple[list, Exception | None, bool]:
    """A transport's `replies` (ranks `first`.. in order) read as (every detail answered, the
    first error or None, whether the group broke: a rank died, did not answer, or failed on its
    own, which ends its process)."""
    error, results, broken = None, [], False
    for rank, reply in enumerate(replies, start=first):
        if isinstance(reply, Exception):
            broken = True
            error = error or reply
            continue
        kind, detail = reply
        if kind != expected:
            broken = broken or isinstance(detail, str)
            error = error or peer_error(detail, rank, what)
        results.append(detail)
    return results, error, broken


def peer_error(detail, rank: int, what: str) -> Exception:
    """A peer's error answer as the exception rank 0 raises: a shared failure's wire form
    (`RankWorker.call`) as its own class, the peer's own failure (text) as a BackendError."""
    if isinstance(detail, dict):
        return from_wire(detail["status"], detail)
    return BackendError(f"trainer rank {rank} failed during {what}: {detail}")
