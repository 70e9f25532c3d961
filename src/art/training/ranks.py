"""Data-parallel training on torch.distributed: several ranks share one update.

Every rank holds the same weights and optimizer state and receives the same groups. Each
mini-batch is split into per-rank shards (`Collective.shard`: whole groups, balanced by
tokens). Each rank runs its shard's micro-batches, with the loss still normalised by the
*whole* mini-batch (`Normalizer`). The gradients are then summed across ranks (one flat
all-reduce per optimizer step), which gives exactly the single-process gradient up to float
summation order, and every rank applies the same clipped AdamW step. gloo on CPU, NCCL on CUDA.

Rank 0 is the trainer inside the backend (it shares its model with the engine). Ranks
1..N-1 are processes started by `RankPeers` (or, on a cluster, by Ray: `art.ray_cluster`). Each
holds its own copy of the model and obeys commands sent over a pipe: restore a checkpoint
folder, train a step, close. The process group carries only the tensors of a step. Sharded
(`art.training.sharded`, FSDP2), every rank is such a process and also saves and scores.
A failed step is rolled back by the backend; if a rank died (or a collective broke), the next
restore starts every peer again, so the following step trains cleanly. Rank 0 waits for its
peers only in `Collective`'s watched waits: while a step runs, a `PeerWatcher` thread polls the
peers and, when one dies, ends those waits (and aborts an NCCL group), so the step fails at
once and rolls back instead of hanging in a collective (gloo notices a closed socket by itself,
NCCL does not notice at all).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import pickle
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from art.errors import ArtValueError, BackendError, StepCancelledError
from art.training.sequences import Sequence

log = logging.getLogger(__name__)

STEP_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective waits for a slow rank before the step fails (and rolls back)."""
WATCH_INTERVAL_S = 0.2
"""How often the `PeerWatcher` looks at the peers during a step."""
STOP_KEY = "art/stop"
"""Set in the group's store to cancel the running step (sharded ranks have no rank 0 in the
backend to decide it); deleted when a step begins."""


class Collective:
    """One rank's view of the training group. `world == 1` (no group) is the single process."""

    def __init__(self, rank: int = 0, world: int = 1, group=None, store=None,
                 device: str | torch.device = "cpu", sharded: bool = False) -> None:
        self.rank, self.world, self.group, self.store = rank, world, group, store
        self.device = torch.device(device)
        """Where the group's tensors live (NCCL needs them on the rank's GPU)."""
        self.sharded = sharded
        """The model is FSDP2-sharded over the group (`art.training.sharded`): its backward
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
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def sum_values(self, values: Counter) -> Counter:
        """Per-rank sums (loss terms, token counts) summed across ranks; every rank gets them."""
        if self.world == 1:
            return values
        gathered = self.gather(dict(values))
        total: Counter = Counter()
        for part in gathered:
            total.update(part)
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


def start_group(rank: int, world: int, device: torch.device, *, store: dist.TCPStore | None = None,
                port: int | None = None, host: str = "127.0.0.1") -> Collective:
    """Join a process group of `world` ranks (rank 0 passes its `store`, the others its
    `port`): gloo on CPU, NCCL on CUDA. A group object of its own, not torch's default group,
    so one process may hold several models' groups. Returns once every rank has joined."""
    if store is None:
        store = dist.TCPStore(host, port, world, False, timeout=STEP_TIMEOUT)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = STEP_TIMEOUT  # NCCL's default is 10 minutes, after which its watchdog ends the process
        group = dist.ProcessGroupNCCL(store, rank, world, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, STEP_TIMEOUT)
    return Collective(rank, world, group, store, device)


def join_default_group(rank: int, world: int, device: torch.device, port: int,
                       host: str = "127.0.0.1") -> Collective:
    """A sharded rank's group: torch's default group (what FSDP2 runs on), one per process."""
    store = dist.TCPStore(host, port, world + 1, False, timeout=STEP_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=STEP_TIMEOUT)
    return Collective(rank, world, dist.distributed_c10d._get_default_group(), store, device, sharded=True)


def rank_device(spec_device: str, rank: int) -> torch.device:
    """A peer's device: the CPU, or on CUDA one GPU per rank (rank 0, the backend's, on the first)."""
    device = torch.device(spec_device)
    if device.type != "cuda":
        return device
    first = device.index or 0
    return torch.device("cuda", (first + rank) % torch.cuda.device_count())


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
    """FSDP2 over every rank (`art.training.sharded`); full fine-tuning only."""


def build_trainer(spec: RankSpec, collective: Collective):
    """A rank's model and Trainer, built the way `ModelService` builds rank 0's."""
    from art import base_models
    from art.training.trainer import Trainer

    dtype, device = getattr(torch, spec.dtype), collective.device
    model, tokenizer = base_models.load_policy(spec.base_model, spec.lora, dtype=dtype, device=device)
    gather = None
    if spec.sharded:
        from art.training.sharded import mixed_precision, shard_model

        gather = shard_model(model, device, dtype)
    trainer = Trainer(model, tokenizer, device=device, dtype=dtype, collective=collective, gather=gather,
                      load_reference=base_models.reference_loader(spec.base_model, spec.lora, dtype=dtype,
                                                                  device=device))
    if spec.sharded and mixed_precision(dtype).param_dtype is not None:
        trainer.autocast = False  # FSDP2 gathers the weights in `dtype` already
    return trainer


def rank_threads() -> int:
    """torch threads per CPU peer (`ART_RANK_THREADS`, default 1)."""
    return max(1, int(os.environ.get("ART_RANK_THREADS", "1")))


def peer_main(rank: int, world: int, port: int, spec: RankSpec, connection) -> None:
    """A peer process: join the group, build the model, then `obey` the backend's commands."""
    device = rank_device(spec.device, rank)
    if device.type == "cuda":  # first: the CUDA context, NCCL's streams and every kernel on this rank's GPU
        torch.cuda.set_device(device)
    torch.set_num_threads(rank_threads())
    collective = (join_default_group if spec.sharded else start_group)(rank, world, device, port=port)
    try:
        trainer = build_trainer(spec, collective)
    except BaseException as exc:
        connection.send(("error", f"rank {rank} could not build its model: {type(exc).__name__}: {exc}"))
        return
    connection.send(("ready", None))
    while True:
        command, *args = connection.recv()
        if command == "close":
            return
        obey(trainer, rank, command, args, connection.send)


def obey(trainer, rank: int, command: str, args, answer) -> None:
    """Run one of the backend's commands on a peer's trainer: "restore" or "save" a folder,
    "step", or "logprobs" of the probe; `answer` ("ok", result) or ("error", message). Rank 0
    (a peer only when sharded) answers the step's (metrics, trainer logprob rows) and sends
    ("progress", (done, total, metrics)) after each optimizer step. A failure every rank shares
    (a cancel, a diverged step) is only answered; one of the peer's own also ends its process,
    so the ranks waiting on it in a collective fail at once instead of at the timeout."""
    try:
        result = None
        if command == "restore":
            trainer.restore(Path(args[0]))
        elif command == "save":
            trainer.save(Path(args[0]))
        elif command == "logprobs":
            result = trainer.probe_logprobs(*args)
        else:
            progress = None if rank else (lambda *event: answer(("progress", event)))
            metrics = trainer.step(*args, desc=f"rank {rank}", quiet=True, on_optimizer_step=progress,
                                   should_stop=trainer.collective.stop_requested)
            result = None if rank else (metrics, trainer.last_trainer_logprobs)
        answer(("ok", result))
    except (StepCancelledError, ArtValueError) as exc:  # raised on every rank alike
        answer(("error", f"{type(exc).__name__}: {exc}"))
    except BaseException as exc:
        log.error("trainer rank %d failed; its process ends", rank, exc_info=True)
        answer(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        os._exit(1)


class RankPeers:
    """The backend's handle on the trainer ranks it runs as local processes: ranks 1..N-1,
    which train in step with rank 0 (the backend's own trainer), or, sharded, all N."""

    def __init__(self, world: int, spec: RankSpec) -> None:
        if world < 2 and not spec.sharded:
            raise ArtValueError(f"trainer_ranks must be at least 2 to start peers, got {world}", field="trainer_ranks")
        self.world, self.spec = world, spec
        self.first = 0 if spec.sharded else 1
        """The lowest rank run as a peer."""
        self.collective = Collective()
        self._processes: list = []
        self._connections: list = []
        self._store = None  # the group's store (rank 0's, or sharded the backend's)
        self._watcher: PeerWatcher | None = None
        self.healthy = False

    def start(self) -> Collective:
        """(Re)start every peer and the group; returns rank 0's new collective."""
        if torch.device(self.spec.device).type == "cuda" and self.world > torch.cuda.device_count():
            raise ArtValueError(f"trainer_ranks={self.world} needs a GPU per rank; this machine has "
                                f"{torch.cuda.device_count()} (placement 'ray' spreads ranks over a cluster)",
                                field="trainer_ranks")
        self.close()
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or CUDA state
        self._store = store = host_store(self.world + (self.first == 0))  # sharded: the backend holds it, no rank
        for rank in range(self.first, self.world):
            ours, theirs = context.Pipe()
            process = context.Process(target=peer_main, args=(rank, self.world, store.port, self.spec, theirs),
                                      name=f"art-trainer-rank-{rank}", daemon=True)
            process.start()
            self._processes.append(process)
            self._connections.append(ours)
        if self.first:
            self.collective = self._join_watching(store)
        self._answers("ready", what="start")
        self.healthy = True
        log.info("trainer ranks %d-%d started%s", self.first, self.world - 1, " (sharded)" if self.spec.sharded else "")
        return self.collective

    def _join_watching(self, store: dist.TCPStore) -> Collective:
        """Rank 0 joins the group while its peers are watched: a peer that ends before joining
        would leave the rendezvous waiting for it until STEP_TIMEOUT. (The join, which cannot be
        interrupted, is then left to time out on its thread.)"""
        joined: dict = {}

        def join() -> None:
            try:
                joined["collective"] = start_group(0, self.world, torch.device(self.spec.device), store=store)
            except BaseException as exc:  # raised on the caller's thread below
                joined["error"] = exc

        thread = threading.Thread(target=join, name="art-trainer-rank-0-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = self._dead()
            if dead is not None and thread.is_alive():
                raise BackendError(f"trainer rank {dead[0]} ended (exit code {dead[1]}) before joining the group; "
                                   "its error is in the output above")
        if "error" in joined:
            raise joined["error"]
        return joined["collective"]

    def restore(self, folder: Path) -> Collective:
        """Every peer loads the checkpoint rank 0 restored; peers that died (or a broken group)
        are started again first."""
        if not self.healthy or not self._all_alive():
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
            self._watcher = PeerWatcher(self.collective, self._dead)

    def end_step(self, failed: bool, on_progress=None, should_stop=None) -> list:
        """Wait for every peer's step and return their results; raise the first error (or mark
        the group broken when rank 0 itself failed, since its peers may be stuck in a
        collective). `on_progress` gets rank 0's progress events; `should_stop` is polled
        meanwhile and, once True, cancels the step on every peer."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        try:
            return self._answers("ok", what="step", timeout=5.0 if failed else None, on_progress=on_progress,
                                 should_stop=should_stop)
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
            raise BackendError(f"{exc}; the step is rolled back, and ranks that died are started again before the "
                               "next step") from exc

    def command(self, name: str, *args):
        """Sharded: run "save" or "logprobs" on every rank; rank 0's result."""
        if not self.healthy:
            raise BackendError("the trainer ranks are not running (a failed step?); restore a checkpoint first")
        self._send(name, *args)
        return self._answers("ok", what=name)[0]

    def _all_alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def _dead(self) -> tuple[int, int | None] | None:
        """(rank, exit code) of a peer process that ended, or None while all live."""
        return next(((rank, p.exitcode) for rank, p in enumerate(self._processes, start=self.first)
                     if p.exitcode is not None), None)

    def _send(self, *message) -> None:
        for rank, connection in enumerate(self._connections, start=1):
            try:
                connection.send(message)
            except OSError as exc:
                self.healthy = False
                raise BackendError(f"trainer rank {rank} is gone ({type(exc).__name__}); the ranks are started "
                                   "again at the next restore") from exc

    def _answers(self, expected: str, *, what: str, timeout: float | None = None, on_progress=None,
                 should_stop=None) -> list:
        """Each peer's answer, in rank order (raises the first error once all answered)."""
        first, results = None, []
        deadline = time.monotonic() + (timeout if timeout is not None else STEP_TIMEOUT.total_seconds())
        for rank, (process, connection) in enumerate(zip(self._processes, self._connections), start=self.first):
            try:
                kind, detail = self._receive(connection, deadline, on_progress, should_stop)
            except TimeoutError:
                self.healthy = False
                first = first or BackendError(f"trainer rank {rank} did not answer {what} in time")
                continue
            except PeerDied as died:  # this rank may wait for the dead one in a collective for ever
                self.healthy = False
                first = first or BackendError(f"trainer rank {died.args[0]} died during {what} (exit code "
                                              f"{died.args[1]})")
                continue
            except (EOFError, OSError):
                self.healthy = False
                first = first or BackendError(f"trainer rank {rank} died during {what} (exit code {process.exitcode})")
                continue
            if kind != expected:
                if not process.is_alive() or "\n" in (detail or ""):
                    self.healthy = False
                first = first or peer_error(detail, rank, what)
            results.append(detail)
        if first is not None:
            raise first
        return results

    def _receive(self, connection, deadline: float, on_progress, should_stop) -> tuple[str, object]:
        """The next answer on `connection`, passing progress events on and polling `should_stop`.
        Raises PeerDied when another peer's process ended meanwhile: this one may be waiting for
        it in a collective (the store's waits do not notice a dead rank), so it is not waited for."""
        while True:
            if should_stop is not None and should_stop():
                self._store.set(STOP_KEY, "1")
            if not connection.poll(max(0.0, min(0.2, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError
                dead = self._dead()
                if dead is not None and not connection.poll(1.0):  # a last chance to answer its own error
                    raise PeerDied(*dead)
                continue
            kind, detail = connection.recv()
            if kind != "progress":
                return kind, detail
            if on_progress is not None:
                on_progress(*detail)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        for connection in self._connections:
            try:
                connection.send(("close",))
            except (OSError, BrokenPipeError):
                pass
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes, self._connections, self._store = [], [], None
        self.collective = Collective()
        self.healthy = False


class PeerLost(RuntimeError):
    """A wait of rank 0 on the group ended because a peer died (`Collective.abandon`); the step
    fails like a broken collective, and is rolled back."""


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


def peer_error(detail: str, rank: int, what: str) -> Exception:
    """A peer's answer ("Kind: message") as the exception rank 0 raises."""
    if detail.startswith("StepCancelledError"):
        return StepCancelledError(detail.split(": ", 1)[-1])
    if detail.startswith("ArtValueError"):
        return ArtValueError(detail.split(": ", 1)[-1])
    return BackendError(f"trainer rank {rank} failed during {what}: {detail}")
