"""Data-parallel training on torch.distributed: the processes that hold the trainer ranks.

Rank 0 is the trainer inside the backend (it shares its model with the engine). Ranks
1..N-1 are processes started by `RankPeers` (or, on a cluster, by Ray: `art.ray_cluster`). Each
holds its own copy of the model and runs commands sent over a pipe (`RankWorker`): restore a
checkpoint folder, train a step, close. The process group (`art.training.collective`) carries
only the tensors of a step. Sharded (`art.training.fsdp`, FSDP2), every rank is such a process
and also saves and scores.
A failed step is rolled back by the backend; if a rank died (or a collective broke), the next
restore starts every peer again, so the following step trains cleanly. Rank 0 waits for its
peers only in `Collective`'s watched waits: while a step runs, a `PeerWatcher` thread polls the
peers and, when one dies, ends those waits (and aborts an NCCL group), so the step fails at
once and rolls back instead of hanging in a collective (gloo notices a closed socket by itself,
NCCL does not notice at all).

The backend holds a group of ranks through `LeadTrainer` (rank 0 trains here, its peers
alongside) or `ShardedTrainer` (every rank is a process); both answer what `LoadedModel` asks
of a `Trainer`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import art.base_models
from art.devices import device_for, local_gpus, process_threads, use_device
from art.errors import ArtError, ArtValueError, BackendError, StepCancelledError, from_wire, to_wire
from art.training.collective import STEP_TIMEOUT, STOP_KEY, Collective, host_store, join_default_group, start_group
from art.training.fsdp import mixed_precision, shard_model
from art.training.trainer import Trainer
from art.weights import load_full_weights

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
"""How often the `PeerWatcher` looks at the peers during a step."""
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

    def __init__(self, trainer: Trainer, rank: int, answer) -> None:
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

    def step(self, groups, options):
        """One training step; rank 0 (a peer only when sharded) returns (metrics, trainer logprob
        rows) and sends ("progress", (done, total, metrics)) after each optimizer step."""
        progress = None if self.rank else (lambda *event: self.answer(("progress", event)))
        metrics = self.trainer.step(
            groups,
            options,
            desc=f"rank {self.rank}",
            quiet=True,
            on_optimizer_step=progress,
            should_stop=self.trainer.collective.stop_requested,
        )
        return None if self.rank else (metrics, self.trainer.last_trainer_logprobs)


class ProcessRanks:
    """The ranks as local processes, spoken to over pipes: how `RankPeers` reaches them by
    default (`art.ray_cluster.RayRanks` reaches Ray actors instead). A transport starts the
    ranks, sends them a command, collects their replies, and says which one died."""

    def __init__(self, world: int, spec: RankSpec, first: int) -> None:
        self.world, self.spec, self.first = world, spec, first
        self.processes: list = []
        self._connections: list = []

    def host(self) -> str:
        """Where the group's store listens."""
        return "127.0.0.1"

    def start(self, store: dist.TCPStore, join) -> Collective | None:
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

    def _join_watching(self, join) -> Collective:
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

    def replies(self, what: str, deadline: float, on_progress=None, poll=None) -> list:
        """Each rank's reply to the last command, in rank order: its (kind, detail), or the
        BackendError of a rank that died or did not answer by `deadline`. `poll()` runs meanwhile."""
        out: list = []
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

    def __init__(self, world: int, spec: RankSpec, transport=None) -> None:
        if world < 2 and not spec.sharded:
            raise ArtValueError(f"trainer_ranks must be at least 2 to start peers, got {world}", field="trainer_ranks")
        self.world, self.spec = world, spec
        self.first = 0 if spec.sharded else 1
        """The lowest rank run as a peer."""
        self.transport = (transport or ProcessRanks)(world, spec, self.first)
        self.collective = Collective()
        self._store = None  # the group's store (rank 0's, or sharded the backend's)
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
        self._store.delete_key(STOP_KEY)
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
                self._store.set(STOP_KEY, "1")

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


class LeadTrainer:
    """Rank 0 of a data-parallel group: the backend's `Trainer`, whose `peers` train each step
    alongside and load each checkpoint it restores. Everything else is the trainer's own."""

    def __init__(self, trainer: Trainer, peers: RankPeers) -> None:
        self.trainer, self.peers = trainer, peers
        trainer.collective = peers.collective

    def __getattr__(self, name: str):
        return getattr(self.trainer, name)

    def step(
        self, groups, options, *, desc: str = "train", on_optimizer_step=None, should_stop=None, quiet: bool = False
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

    def restore(self, folder: Path) -> None:
        self.trainer.restore(folder)
        self.sync_peers(folder)

    def sync_peers(self, folder: Path) -> None:
        """Every peer loads checkpoint `folder`, the one rank 0 holds (peers that died are
        started again first)."""
        self.trainer.collective = self.peers.restore(Path(folder))


class ShardedTrainer:
    """The backend's handle on a sharded trainer: what `LoadedModel` asks of a `Trainer`
    (step, save, restore, the probe's logprobs), done by the rank processes in `peers`. `model`
    is the engine's served copy; it takes the weights of each checkpoint written or restored."""

    full_finetune = True

    def __init__(self, model, peers: RankPeers, *, lock, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.peers, self.lock = model, peers, lock
        self.device, self.dtype = torch.device(device), dtype
        self.last_trainer_logprobs: list[dict] = []
        peers.start()  # the ranks build the base model's shards; a checkpoint is restored into them next

    def step(
        self, groups, options, *, desc: str = "train", on_optimizer_step=None, should_stop=None, quiet: bool = False
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

    def compute_precision(self):
        return contextlib.nullcontext()

    def _serve(self, folder: Path) -> None:
        with self.lock:
            load_full_weights(self.model, Path(folder))
