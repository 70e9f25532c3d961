"""Engine replicas: N copies of a model's engine behind one OpenAI endpoint.

Replica 0 is the backend's own engine: it shares the trainer's model. Replicas 1..N-1 are
processes of their own (`art.engine.replica_process`; on a cluster, Ray actors: `art.ray_cluster`), each with a
copy of the model and an `LLMEngine`. `ReplicaSet` is itself an `Engine`, so the HTTP app
does not know replicas exist. Each `generate` goes to one replica (`art.engine.router`): the replica
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
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence

from art.devices import device_for, local_gpus
from art.engine.base import AdapterRef, Completion, Engine, SampledTokens, SamplingParams
from art.engine.replica_process import CalledReplica, ProcessReplica, ReplicaSpec, labelled
from art.engine.router import PrefixRouter, Replica

log = logging.getLogger(__name__)


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

    async def stream(
        self, prompt: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> AsyncGenerator[SampledTokens | list[Completion], None]:
        """`Engine.stream` of this replica: tokens as they are sampled, then the completions."""
        self.in_flight += 1
        events = self.engine.stream(prompt, params, adapter)
        try:
            async for item in events:
                yield labelled(item, 0)
        finally:
            self.in_flight -= 1
            await events.aclose()


class ReplicaSet(Engine):
    """Implements `art.engine.base.Engine` over replicas (see the module docstring); replica 0 is `engine`."""

    def __init__(
        self,
        engine,
        spec: ReplicaSpec,
        count: int,
        replica_class: Callable[[int, ReplicaSpec], CalledReplica] | None = None,
        dedicated: bool = False,
    ) -> None:
        """`replica_class` builds replicas 1..N-1: `ProcessReplica` (default, one GPU each on
        CUDA: more replicas than GPUs are refused here) or `art.ray_cluster.RayReplica`.
        `dedicated`: replicas 1..N-1 do all the sampling; replica 0 shares the trainer's device
        and stands in only while none of them is live."""
        self.tokenizer, self.max_model_len, self.grammars = engine.tokenizer, engine.max_model_len, engine.grammars
        if replica_class is None and count > 1:  # a GPU for every replica, before any process starts
            device_for(spec.engine.device, count - 1, local_gpus(spec.engine.device), "engine_replicas")
        replica_class = replica_class or ProcessReplica
        self._peers = [replica_class(i, spec) for i in range(1, count)]
        self.replicas: list[LocalReplica | CalledReplica] = [LocalReplica(engine), *self._peers]
        self.router = PrefixRouter()
        self.dedicated = dedicated

    @property
    def peers(self) -> list[CalledReplica]:
        """Replicas 1..N-1 (processes or Ray actors)."""
        return list(self._peers)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> list[Completion]:
        replica = self.router.choose(self._routable(adapter), prompt_token_ids)
        return await replica.generate(prompt_token_ids, params, adapter)

    async def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> AsyncGenerator[SampledTokens | list[Completion], None]:
        """`Engine.stream` through one replica: replica 0 and process replicas send each token as
        it is sampled; a Ray replica sends them when its completions are done."""
        replica = self.router.choose(self._routable(adapter), prompt_token_ids)
        events = replica.stream(prompt_token_ids, params, adapter)
        try:
            async for item in events:
                yield item
        finally:
            await events.aclose()

    def _routable(self, adapter: AdapterRef | None) -> Sequence[LocalReplica | CalledReplica]:
        """Replicas that may serve `adapter`. Dedicated samplers: the live peers, a loading one
        included (the request waits behind the load; the answer carries the step that sampled
        it). Otherwise, for the live weights, those holding the latest step (a replica still
        loading a new step is skipped rather than serve the old one as new)."""
        if self.dedicated and (live := [r for r in self.peers if r.down is None]):
            return live
        if adapter is None or adapter.path is not None or not self.peers:
            return self.replicas
        latest = self.replicas[0].step
        return [r for r in self.replicas if r.step == latest]

    async def publish(self, step: int, weights, probe) -> dict[str, float]:
        """Load `weights` of `step` into every live process replica, then run `probe(replica)`
        (the weight-sync check) on each; a replica that fails either leaves the rotation.
        Returns how many replicas serve the step."""
        peers = [r for r in self.peers if r.down is None]

        async def one(replica: CalledReplica) -> None:
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
        return {
            "replicas": [
                {
                    "replica": r.index,
                    "serving": r.down is None,
                    "down": r.down,
                    "step": r.step,
                    "in_flight": r.in_flight,
                }
                for r in self.replicas
            ]
        }

    def close(self) -> None:
        for replica in self.peers:
            replica.close()


def _collect(function, errors: list) -> None:
    try:
        function()
    except BaseException as exc:
        errors.append(exc)
