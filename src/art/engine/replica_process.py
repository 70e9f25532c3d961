"""Both ends of the pipe to a replica in a process of its own.

The replica's end (`replica_main`) builds an engine and answers requests concurrently, each
command a method of `ReplicaWorker`; the backend's end (`ProcessReplica`) sends them and
settles each request's future from one reader thread. `CalledReplica` is what any replica in
another process offers the router (a Ray actor's too: `art.ray_cluster.RayReplica`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from art.devices import device_for, local_gpus, use_device
from art.engine.base import AdapterRef, Completion, SampledTokens, SamplingParams, all_tokens
from art.engine.config import EngineConfig
from art.engine.router import Replica, ReplicaUnavailableError
from art.errors import ArtValueError, BackendUnavailableError, ModelNotFoundError, from_wire, to_wire
from art.weights import load_full_weights

log = logging.getLogger(__name__)

REPLICA_THREADS = "ART_REPLICA_THREADS"
"""The environment variable of torch threads per CPU replica process (`art.devices.process_threads`)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process needs to build the same served model as the backend."""

    base_model: str
    lora: dict | None
    """peft LoraConfig arguments; None for a fully fine-tuned model."""
    engine: EngineConfig
    """The backend's engine config, resolved (device and dtype concrete)."""
    threads: int = 1
    """torch threads of a CPU replica."""


def build_engine(spec: ReplicaSpec, device: str):
    """A replica's model and engine on `device`, built the way `art.service.build` builds the backend's."""
    import art.base_models
    from art.engine.adapters import AdapterSet
    from art.engine.llm_engine import LLMEngine

    config = dataclasses.replace(spec.engine, device=device)
    model, tokenizer = art.base_models.load_policy(
        spec.base_model, spec.lora, dtype=config.torch_dtype, device=config.device, trainable=False
    )
    return LLMEngine(model, tokenizer, config, adapters=AdapterSet(model))


def load_weights(engine, step: int, weights) -> None:
    """Replace the live weights: adapter tensors (LoRA) or a checkpoint folder (full fine-tuning)."""
    with engine.paused():
        if isinstance(weights, dict):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(engine.model, weights, adapter_name="default")
        else:
            load_full_weights(engine.model, weights)
        engine.adapters.live_step = step
        engine.weights_updated(step)


def replica_main(index: int, spec: ReplicaSpec, connection) -> None:
    """A replica process: build the engine, then answer requests from the pipe concurrently
    (each `generate` is a task; the engine batches them)."""
    try:
        device = device_for(spec.engine.device, index, local_gpus(spec.engine.device), "engine_replicas")
        use_device(device)
        torch.set_num_threads(spec.threads)
        engine = build_engine(spec, device)
    except BaseException as exc:
        connection.send(("error", 0, error_payload(exc)))
        return
    connection.send(("ok", 0, None))
    asyncio.run(_serve(engine, connection))


async def _serve(engine, connection) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    send_lock = threading.Lock()

    def read() -> None:
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                message = ("close", 0)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "close":
                return

    def send(message) -> None:
        with send_lock:
            connection.send(message)

    worker = ReplicaWorker(engine, send)
    threading.Thread(target=read, name="art-replica-reader", daemon=True).start()
    tasks: set[asyncio.Task] = set()
    while True:
        kind, request_id, *args = await inbox.get()
        if kind == "close":
            engine.stop()
            return
        task = asyncio.ensure_future(worker.call(kind, request_id, *args))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


class ReplicaWorker:
    """A replica's engine and the backend's requests, one method each. Every method takes the
    request's id first (a stream's tokens travel ahead of its answer under it); `send` puts a
    message on the pipe."""

    COMMANDS = frozenset({"generate", "stream", "load"})
    """What the backend may ask (`call`)."""

    def __init__(self, engine, send: Callable[[tuple], None]) -> None:
        self.engine, self.send = engine, send

    async def call(self, kind: str, request_id: int, *args) -> None:
        """Run request `kind` and answer it: ("ok", id, result) or ("error", id, `error_payload`)."""
        try:
            if kind not in self.COMMANDS:
                raise ValueError(f"unknown replica request {kind!r}")
            result = await getattr(self, kind)(request_id, *args)
            self.send(("ok", request_id, result))
        except BaseException as exc:
            self.send(("error", request_id, error_payload(exc)))

    async def generate(
        self, request_id: int, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> list[Completion]:
        return await self.engine.generate(prompt, params, adapter)

    async def stream(
        self, request_id: int, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> list[Completion]:
        """Each step's tokens sent as they are sampled; returns the completions."""
        async for result in self.engine.stream(prompt, params, adapter):
            if not isinstance(result, list):
                self.send(("tokens", request_id, result))
        return result

    async def load(self, request_id: int, step: int, weights) -> None:
        """New live weights (`load_weights`), off the event loop so requests keep being served."""
        return await asyncio.to_thread(load_weights, self.engine, step, weights)


_PASSED_ON = (ArtValueError, ModelNotFoundError)
"""A request's own errors, raised to the caller as they are; any other means the replica failed."""


def error_payload(exc: BaseException) -> dict:
    """An exception as it crosses to the backend: a request's own error in its wire form
    (`art.errors.to_wire`), any other as its class name and message (status None)."""
    if isinstance(exc, _PASSED_ON):
        return to_wire(exc)
    return {"status": None, "message": f"{type(exc).__name__}: {exc}"}


def revive_error(payload: dict, index: int) -> Exception:
    """The backend's exception for a replica's `error_payload`."""
    if payload["status"] is not None:
        return from_wire(payload["status"], payload)
    return BackendUnavailableError(f"replica {index}: {payload['message']}")


class CalledReplica(Replica):
    """A replica in another process, reached through `call(kind, *args)`: a local process
    (`ProcessReplica`) or a Ray actor (`art.ray_cluster.RayReplica`)."""

    step: int | None = None
    """The training step whose weights it holds (set once it started, and by each `load`)."""

    async def call(self, kind: str, *args):
        raise NotImplementedError

    def start(self) -> None:
        """Start it and wait until its engine is built (blocking: call off the event loop)."""
        raise NotImplementedError

    def mark_down(self, reason: str) -> None:
        """Take it out of the rotation, saying why; its open requests fail."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop it; it serves nothing more."""
        raise NotImplementedError

    async def generate(self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None) -> list[Completion]:
        self.in_flight += 1
        try:
            completions = await self.call("generate", list(prompt), params, adapter)
        finally:
            self.in_flight -= 1
        for c in completions:
            c.replica = self.index
        return completions

    async def stream(
        self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> AsyncGenerator[SampledTokens | list[Completion], None]:
        """`Engine.stream` of this replica; here every token comes at the end (a replica that
        can send them across as they are sampled overrides it)."""
        completions = await self.generate(prompt, params, adapter)
        for tokens in all_tokens(completions):
            yield tokens
        yield completions

    async def load(self, step: int, weights) -> None:
        await self.call("load", step, weights)
        self.step = step


class ProcessReplica(CalledReplica):
    """A replica in a process of its own, spoken to over a pipe (one reader thread settles the
    futures of its requests)."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        self.index, self.spec = index, spec
        self.down = "not started"
        self._process: BaseProcess | None = None
        self._connection: Connection | None = None
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._listeners: dict[int, Callable[[SampledTokens], None]] = {}
        """A streamed request's callback for the tokens the replica sends before its answer."""
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the process and wait until its engine is built (blocking: call off the event loop)."""
        self.close()
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(
            target=replica_main, args=(self.index, self.spec, theirs), name=f"art-replica-{self.index}", daemon=True
        )
        self._process = process
        process.start()
        self._connection = ours
        kind, _, detail = ours.recv()  # "ok" once its engine is built
        if kind != "ok":
            self.close()
            raise revive_error(detail, self.index)
        self.down, self.step = None, 0
        reader = threading.Thread(
            target=self._read, args=(process, ours), name=f"art-replica-{self.index}-reader", daemon=True
        )
        reader.start()

    def _read(self, process: BaseProcess, connection: Connection) -> None:
        """Settle this process's requests from its end of the pipe until the pipe closes."""
        while True:
            try:
                kind, request_id, detail = connection.recv()
            except (EOFError, OSError):
                break
            if kind == "tokens":  # a streamed request's tokens, before its answer
                pending = self._pending.get(request_id)
                listener = self._listeners.get(request_id)
                if pending is not None and listener is not None:
                    pending[0].call_soon_threadsafe(listener, detail)
                continue
            self._listeners.pop(request_id, None)
            settled = self._pending.pop(request_id, None)
            if settled is None:
                continue
            loop, future = settled
            if kind == "ok":
                loop.call_soon_threadsafe(_settle, future, detail, None)
            else:
                loop.call_soon_threadsafe(_settle, future, None, revive_error(detail, self.index))
        if connection is self._connection and not self._closing:  # not a replaced or closed process's reader
            process.join(timeout=1)
            self.mark_down(f"its process stopped (exit code {process.exitcode})")

    def mark_down(self, reason: str) -> None:
        if self.down is None:
            log.error("replica %d leaves the rotation: %s", self.index, reason)
        self.down = reason
        self._fail_pending(reason)

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        self._listeners = {}
        for loop, future in pending.values():
            loop.call_soon_threadsafe(
                _settle,
                future,
                None,
                ReplicaUnavailableError(
                    f"replica {self.index} stopped while serving this request ({reason}); send it again: the other "
                    "replicas serve"
                ),
            )

    async def call(self, kind: str, *args, listener: Callable[[SampledTokens], None] | None = None):
        """Send a request and await its answer; `listener` gets the tokens of a "stream" request."""
        connection = self._connection  # None once closed (by another thread, while this request came in)
        if self.down is not None or connection is None:
            raise ReplicaUnavailableError(f"replica {self.index} is out of rotation: {self.down or 'closed'}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        request_id = next(self._ids)
        self._pending[request_id] = (loop, future)
        if listener is not None:
            self._listeners[request_id] = listener
        try:
            with self._send_lock:
                connection.send((kind, request_id, *args))
        except OSError as exc:
            self._pending.pop(request_id, None)
            self._listeners.pop(request_id, None)
            self.mark_down(f"its pipe broke ({type(exc).__name__})")
            raise ReplicaUnavailableError(f"replica {self.index} is gone; send the request again") from exc
        return await future

    async def stream(
        self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> AsyncGenerator[SampledTokens | list[Completion], None]:
        """`Engine.stream` across the pipe: the replica sends each step's tokens as it samples them."""
        queue: asyncio.Queue = asyncio.Queue()
        self.in_flight += 1
        call = asyncio.ensure_future(self.call("stream", list(prompt), params, adapter, listener=queue.put_nowait))
        call.add_done_callback(queue.put_nowait)  # after every token: they were queued before the answer
        try:
            while (item := await queue.get()) is not call:
                yield labelled(item, self.index)
            yield labelled(call.result(), self.index)
        finally:
            self.in_flight -= 1
            call.cancel()

    def close(self) -> None:
        self._closing = True
        self.down = self.down or "closed"  # the router sends it nothing more while it stops
        if self._connection is not None:
            try:
                with self._send_lock:
                    self._connection.send(("close", 0))
            except OSError:
                pass
        if self._process is not None:
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._process = self._connection = None
        self._fail_pending("closed")  # what it did not answer before it stopped is answered here
        self._closing = False


def labelled(item: SampledTokens | list[Completion], index: int) -> SampledTokens | list[Completion]:
    """A stream's item marked as sampled by replica `index`."""
    for sampled in item if isinstance(item, list) else [item]:
        sampled.replica = index
    return item


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
