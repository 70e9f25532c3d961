"""Engine replicas: N copies of a model's engine behind one OpenAI endpoint.

Replica 0 is the backend's own engine: it shares the trainer's model. Replicas 1..N-1 are
processes of their own (`replica_main`; on a cluster, Ray actors: `art.ray_cluster`), each with a
copy of the model and an `LLMEngine`. `ReplicaSet` is itself an `Engine`, so the HTTP app
does not know replicas exist. Each `generate` goes to one replica (`PrefixRouter`): the replica
that already holds the prompt's prefix in its cache (a group's samples, a repeated prompt, the
next turn of a conversation), unless that replica is busier than the others by more than
`BALANCE` requests; otherwise the least-loaded one. Every completion says which replica
sampled it (`Completion.replica`, `replica` in the response).

After a training step the backend publishes the new adapter weights to every replica
(`ReplicaSet.publish`); a replica serves a step's label only once it holds that step's weights.
Each then answers the weight-sync probe. A replica that fails the probe, or whose process
dies, leaves the rotation with a logged reason (`GET /health` turns "degraded"); its in-flight
requests fail with a 503 and Retry-After, and new ones go to the live replicas.
`ReplicaSet.restart` starts the dead ones again on the current weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from art.engine.base import AdapterRef, Completion, SampledTokens, SamplingParams, all_tokens
from art.engine.config import EngineConfig
from art.errors import ArtValueError, BackendUnavailableError, ContextLengthError, ModelNotFoundError

log = logging.getLogger(__name__)

BLOCK = 16
"""Tokens per prefix block the router remembers (a prompt's prefix is matched block by block)."""
BALANCE = 8
"""A replica holding a prompt's prefix still gets it unless it has this many more requests in
flight than the least-loaded replica."""
REMEMBERED_BLOCKS = 65536
"""Prefix blocks the router remembers per replica (least recently used forgotten first)."""
RETRY_AFTER_S = 1


class ReplicaUnavailableError(BackendUnavailableError):
    """A replica stopped while serving a request: the request may be sent again (503)."""

    retry_after = RETRY_AFTER_S


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


def replica_device(device: str, index: int, gpus: int) -> str:
    """Replica `index`'s device: the CPU, or on CUDA a GPU of its own out of `gpus`, counted on from
    the backend's (replica 0 on `device`, the next ones after it, wrapping past the last GPU onto
    the first). Raises ArtValueError naming `engine_replicas` when there is no GPU left for it:
    two replicas on one GPU would each size their KV cache from what the other left free, and the
    second would not fit."""
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return device
    if index >= gpus:
        raise ArtValueError(f"engine_replicas={index + 1} needs a GPU per replica; this machine has {gpus} "
                            "(placement 'ray' spreads replicas over a cluster)", field="engine_replicas")
    return f"cuda:{((parsed.index or 0) + index) % gpus}"


def use_device(device: str) -> None:
    """Make a CUDA `device` this process's current one (first thing in a replica or a rank: its
    CUDA context, streams and graph captures then land on its own GPU, not on GPU 0)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))


# -- the replica process -------------------------------------------------------------------


def build_engine(spec: ReplicaSpec, device: str):
    """A replica's model and engine on `device`, built the way `ModelService` builds the backend's."""
    from art import base_models
    from art.engine.adapters import AdapterSet
    from art.engine.llm_engine import LLMEngine

    config = dataclasses.replace(spec.engine, device=device)
    model, tokenizer = base_models.load_policy(spec.base_model, spec.lora, dtype=config.torch_dtype,
                                               device=config.device, trainable=False)
    return LLMEngine(model, tokenizer, config, adapters=AdapterSet(model))


def load_weights(engine, step: int, weights) -> None:
    """Replace the live weights: adapter tensors (LoRA) or a checkpoint folder (full fine-tuning)."""
    with engine.paused():
        if isinstance(weights, dict):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(engine.model, weights, adapter_name="default")
        else:
            from art.training.trainer import load_full_weights

            load_full_weights(engine.model, weights)
        engine.adapters.live_step = step
        engine.weights_updated(step)


def replica_main(index: int, spec: ReplicaSpec, connection) -> None:
    """A replica process: build the engine, then answer requests from the pipe concurrently
    (each `generate` is a task; the engine batches them)."""
    try:
        device = replica_device(spec.engine.device, index, local_gpus(spec.engine.device))
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

    async def answer(kind: str, request_id: int, args) -> None:
        try:
            if kind == "generate":
                result = await engine.generate(*args)
            elif kind == "stream":  # each step's tokens as they are sampled, then the completions
                async for result in engine.stream(*args):
                    if not isinstance(result, list):
                        send(("tokens", request_id, result))
            else:  # "load"
                result = await asyncio.to_thread(load_weights, engine, *args)
            send(("ok", request_id, result))
        except BaseException as exc:
            send(("error", request_id, error_payload(exc)))

    threading.Thread(target=read, name="art-replica-reader", daemon=True).start()
    tasks: set[asyncio.Task] = set()
    while True:
        kind, request_id, *args = await inbox.get()
        if kind == "close":
            engine.stop()
            return
        task = asyncio.ensure_future(answer(kind, request_id, args))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


_ERRORS = {cls.__name__: cls for cls in (ArtValueError, ContextLengthError, ModelNotFoundError)}


def error_payload(exc: BaseException) -> tuple[str, str, str | None]:
    """An exception as it crosses to the backend: (class name, message, field)."""
    return type(exc).__name__, str(exc), getattr(exc, "field", None)


def revive_error(payload, index: int) -> Exception:
    """The backend's exception for a replica's `error_payload`."""
    name, message, field = payload
    if name in ("ArtValueError", "ContextLengthError"):
        return _ERRORS[name](message, field=field)
    if name == "ModelNotFoundError":
        return ModelNotFoundError(message)
    return BackendUnavailableError(f"replica {index}: {name}: {message}")


# -- the backend's side --------------------------------------------------------------------


class Replica:
    """What the router needs of a replica: `index`, `in_flight`, `down` (a reason, or None)."""

    index: int
    in_flight: int = 0
    down: str | None = None
    step: int | None = None
    """The training step whose weights the replica holds."""


class LocalReplica(Replica):
    """Replica 0: the backend's own engine (its weights are the trainer's)."""

    def __init__(self, engine) -> None:
        self.index, self.engine = 0, engine

    @property
    def step(self) -> int:
        return self.engine.adapters.live_step

    async def generate(self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None) -> list[Completion]:
        self.in_flight += 1
        try:
            completions = await self.engine.generate(prompt, params, adapter)
        finally:
            self.in_flight -= 1
        for c in completions:
            c.replica = 0
        return completions

    async def stream(self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None):
        """`Engine.stream` of this replica: tokens as they are sampled, then the completions."""
        self.in_flight += 1
        events = self.engine.stream(prompt, params, adapter)
        try:
            async for item in events:
                yield _labelled(item, 0)
        finally:
            self.in_flight -= 1
            await events.aclose()


class CalledReplica(Replica):
    """A replica in another process, reached through `call(kind, *args)`: a local process
    (`ProcessReplica`) or a Ray actor (`art.ray_cluster.RayReplica`)."""

    async def call(self, kind: str, *args):
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

    async def stream(self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None):
        """`Engine.stream` of this replica; here every token comes at the end (a replica that
        can send them across as they are sampled overrides it)."""
        completions = await self.generate(prompt, params, adapter)
        for item in [*all_tokens(completions), completions]:
            yield item

    async def load(self, step: int, weights) -> None:
        await self.call("load", step, weights)
        self.step = step


class ProcessReplica(CalledReplica):
    """A replica in a process of its own, spoken to over a pipe (one reader thread settles the
    futures of its requests)."""

    def __init__(self, index: int, spec: ReplicaSpec) -> None:
        self.index, self.spec = index, spec
        self.down = "not started"
        self._process = None
        self._connection = None
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
        self._process = context.Process(target=replica_main, args=(self.index, self.spec, theirs),
                                        name=f"art-replica-{self.index}", daemon=True)
        self._process.start()
        self._connection = ours
        kind, _, detail = ours.recv()  # "ok" once its engine is built
        if kind != "ok":
            self.close()
            raise revive_error(detail, self.index)
        self.down, self.step = None, 0
        threading.Thread(target=self._read, name=f"art-replica-{self.index}-reader", daemon=True).start()

    def _read(self) -> None:
        connection = self._connection
        while True:
            try:
                kind, request_id, detail = connection.recv()
            except (EOFError, OSError):
                break
            if kind == "tokens":  # a streamed request's tokens, before its answer
                loop, _ = self._pending.get(request_id, (None, None))
                listener = self._listeners.get(request_id)
                if listener is not None:
                    loop.call_soon_threadsafe(listener, detail)
                continue
            self._listeners.pop(request_id, None)
            loop, future = self._pending.pop(request_id, (None, None))
            if future is None:
                continue
            if kind == "ok":
                loop.call_soon_threadsafe(_settle, future, detail, None)
            else:
                loop.call_soon_threadsafe(_settle, future, None, revive_error(detail, self.index))
        if connection is self._connection and not self._closing:  # not a replaced or closed process's reader
            self._process.join(timeout=1)
            self.mark_down(f"its process stopped (exit code {self._process.exitcode})")

    def mark_down(self, reason: str) -> None:
        if self.down is None:
            log.error("replica %d leaves the rotation: %s", self.index, reason)
        self.down = reason
        self._fail_pending(reason)

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        self._listeners = {}
        for loop, future in pending.values():
            loop.call_soon_threadsafe(_settle, future, None, ReplicaUnavailableError(
                f"replica {self.index} stopped while serving this request ({reason}); send it again: the other "
                "replicas serve"))

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

    async def stream(self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None):
        """`Engine.stream` across the pipe: the replica sends each step's tokens as it samples them."""
        queue: asyncio.Queue = asyncio.Queue()
        self.in_flight += 1
        call = asyncio.ensure_future(self.call("stream", list(prompt), params, adapter, listener=queue.put_nowait))
        call.add_done_callback(queue.put_nowait)  # after every token: they were queued before the answer
        try:
            while (item := await queue.get()) is not call:
                yield _labelled(item, self.index)
            yield _labelled(call.result(), self.index)
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


def _labelled(item: SampledTokens | list[Completion], index: int):
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


class PrefixRouter:
    """Chooses a replica for a prompt: prefix affinity within a load bound, else least loaded.

    Each replica remembers the hashes of the prompt prefixes it served, block by block. The
    replica holding the longest prefix of a prompt *beyond what every live replica holds* (the
    system prompt soon sits everywhere) gets it, unless it has `BALANCE` or more requests in
    flight than the least-loaded replica."""

    def __init__(self) -> None:
        self._seen: dict[int, OrderedDict] = {}
        self._turn = itertools.count()

    def choose(self, replicas: list[Replica], prompt: list[int]) -> Replica:
        live = [r for r in replicas if r.down is None]
        if not live:
            raise ReplicaUnavailableError("no engine replica is serving (see GET /health)")
        blocks = _block_hashes(prompt)
        matched = {r.index: self._matched(r.index, blocks) for r in live}
        shared = min(matched.values())
        least = min(r.in_flight for r in live)
        best = max(live, key=lambda r: (matched[r.index], -r.in_flight))
        if matched[best.index] > shared and best.in_flight < least + BALANCE:
            chosen = best
        else:  # least loaded; ties in turn, so an idle set fills evenly
            idle = [r for r in live if r.in_flight == least]
            chosen = idle[next(self._turn) % len(idle)]
        self._remember(chosen.index, blocks)
        return chosen

    def _matched(self, index: int, blocks: list[int]) -> int:
        seen = self._seen.get(index, {})
        n = 0
        while n < len(blocks) and blocks[n] in seen:
            n += 1
        return n

    def _remember(self, index: int, blocks: list[int]) -> None:
        seen = self._seen.setdefault(index, OrderedDict())
        for block in blocks:
            seen[block] = None
            seen.move_to_end(block)
        while len(seen) > REMEMBERED_BLOCKS:
            seen.popitem(last=False)

    def forget(self, index: int) -> None:
        """A restarted replica holds no prefixes."""
        self._seen.pop(index, None)


def _block_hashes(prompt: list[int]) -> list[int]:
    """One hash per prefix: of the first BLOCK tokens, the first 2*BLOCK, ..., and the whole prompt."""
    out, running = [], 0
    for start in range(0, len(prompt), BLOCK):
        running = hash((running, tuple(prompt[start:start + BLOCK])))
        out.append(running)
    return out


class ReplicaSet:
    """An `Engine` over replicas (see the module docstring); replica 0 is `engine`."""

    def __init__(self, engine, spec: ReplicaSpec, count: int, replica_class=None) -> None:
        """`replica_class` builds replicas 1..N-1: `ProcessReplica` (default, one GPU each on
        CUDA: more replicas than GPUs are refused here) or `art.ray_cluster.RayReplica`."""
        self.tokenizer, self.max_model_len, self.grammars = engine.tokenizer, engine.max_model_len, engine.grammars
        if replica_class is None and count > 1:  # a GPU for every replica, before any process starts
            replica_device(spec.engine.device, count - 1, local_gpus(spec.engine.device))
        replica_class = replica_class or ProcessReplica
        self.replicas: list[Replica] = [LocalReplica(engine)] + [replica_class(i, spec) for i in range(1, count)]
        self.router = PrefixRouter()

    @property
    def peers(self) -> list:
        """Replicas 1..N-1 (processes or Ray actors)."""
        return self.replicas[1:]

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       adapter: AdapterRef | None) -> list[Completion]:
        replica = self.router.choose(self._routable(adapter), prompt_token_ids)
        return await replica.generate(prompt_token_ids, params, adapter)

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None):
        """`Engine.stream` through one replica: replica 0 and process replicas send each token as
        it is sampled; a Ray replica sends them when its completions are done."""
        replica = self.router.choose(self._routable(adapter), prompt_token_ids)
        events = replica.stream(prompt_token_ids, params, adapter)
        try:
            async for item in events:
                yield item
        finally:
            await events.aclose()

    def _routable(self, adapter: AdapterRef | None) -> list[Replica]:
        """Replicas that may serve `adapter`: for the live weights, those holding the latest step
        (a replica still loading a new step is skipped rather than serve the old one as new)."""
        if adapter is None or adapter.path is not None or not self.peers:
            return self.replicas
        latest = self.replicas[0].step
        return [r for r in self.replicas if r.step == latest]

    async def publish(self, step: int, weights, probe) -> dict[str, float]:
        """Load `weights` of `step` into every live process replica, then run `probe(replica)`
        (the weight-sync check) on each; a replica that fails either leaves the rotation.
        Returns how many replicas serve the step."""
        peers = [r for r in self.peers if r.down is None]

        async def one(replica: ProcessReplica) -> None:
            try:
                await replica.load(step, weights)
                await probe(replica)
            except Exception as exc:
                replica.mark_down(f"step {step}: {exc}")

        await asyncio.gather(*(one(r) for r in peers))
        return {"replicas_serving": float(sum(r.down is None for r in self.replicas))}

    def restart(self, step: int, weights) -> list[int]:
        """Start every replica that is out of rotation again on `weights` of `step` (blocking:
        they build their engines in parallel); returns their indices."""
        down = [r for r in self.peers if r.down is not None]
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_collect, args=(r.start, errors)) for r in down]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        started = [r for r in down if r.down is None]

        async def load_all() -> None:
            await asyncio.gather(*(r.load(step, weights) for r in started))

        asyncio.run(load_all())  # a loop of its own: this runs in a worker thread
        for replica in started:
            self.router.forget(replica.index)
            log.info("replica %d restarted at step %d", replica.index, step)
        if errors:  # the others serve; this one says why it could not start
            raise errors[0]
        return [r.index for r in started]

    def stats(self) -> dict:
        return {"replicas": [{"replica": r.index, "serving": r.down is None, "down": r.down, "step": r.step,
                              "in_flight": r.in_flight} for r in self.replicas]}

    def close(self) -> None:
        for replica in self.peers:
            replica.close()


def _collect(function, errors: list) -> None:
    try:
        function()
    except BaseException as exc:
        errors.append(exc)


def local_gpus(device: str) -> int:
    """How many GPUs this machine has for replicas on `device` (0 off CUDA)."""
    return torch.cuda.device_count() if torch.device(device).type == "cuda" else 0


def replica_threads() -> int:
    """torch threads per CPU replica process (`ART_REPLICA_THREADS`, default 1)."""
    return max(1, int(os.environ.get("ART_REPLICA_THREADS", "1")))
