"""The CPU engine: continuous batching, shared prefixes and mixed adapters in one batch.

One engine thread loops: admit waiting requests at the step boundary (scheduler), prefill each
after its longest cached prefix (prefix cache) and sample its n first tokens, then decode one
token for every running row (model runner). Finished rows leave at once; requests are answered
when all their samples finish. It knows nothing about HTTP, chat formats or GRPO.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from art.engine.adapters import LIVE, AdapterSet
from art.engine.base import AdapterRef, Completion, SamplingParams
from art.engine.model_runner import ModelRunner, RunningBatch
from art.engine.prefix_cache import PrefixCache
from art.engine.sampling import make_generator, sample_next
from art.engine.scheduler import Scheduler
from art.engine.sequence import Request, Sample
from art.engine.stopping import StopChecker

log = logging.getLogger(__name__)


class LLMEngine:
    """Implements `art.engine.base.Engine`."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        lock: threading.RLock | None = None,
        adapters: AdapterSet | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        kv_cache_bytes: int = 4 << 30,
        prefix_cache_tokens: int = 16384,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len or limit, limit)
        self.lock = lock or threading.RLock()
        self.adapters = adapters or AdapterSet(model)
        self.runner = ModelRunner(model, self.adapters)
        self.scheduler = Scheduler(max_num_seqs=max_num_seqs, max_kv_tokens=kv_cache_bytes // _kv_bytes_per_token(model.config))
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.batch = RunningBatch(model.config)
        self.stopping = StopChecker(model, tokenizer, self.max_model_len)
        self.steps = 0
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="art-engine", daemon=True)
        self._thread.start()

    # -- API --------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       adapter: AdapterRef | None) -> list[Completion]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(result) -> None:
            def settle() -> None:
                if future.done():
                    return
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            loop.call_soon_threadsafe(settle)

        request = Request(list(prompt_token_ids), params, adapter, deliver)
        request.samples = [Sample(request, i, make_generator(params.seed, i)) for i in range(params.n)]
        with self._cv:
            self.scheduler.add(request)  # raises ArtValueError for what could never fit
            self._cv.notify_all()
        return await future

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop admitting, let running requests finish, then hold the model lock (for a
        weight update). Requests that arrive meanwhile wait and run on the new weights."""
        with self._cv:
            self.scheduler.paused = True
            self._cv.wait_for(lambda: not self.scheduler.running)
        try:
            with self.lock:
                yield
        finally:
            with self._cv:
                self.scheduler.paused = False
                self._cv.notify_all()

    def weights_updated(self, step: int) -> None:
        """The live adapter now holds `step` (called inside `paused()`)."""
        self.prefix_cache.drop(f"{LIVE}@{self.adapters.live_step}")
        self.adapters.live_step = step

    # -- engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.scheduler.running or (self.scheduler.waiting and not self.scheduler.paused))
                admitted = self.scheduler.admit()
            try:
                with self.lock, torch.inference_mode():
                    finished = []
                    for request in admitted:
                        finished += self._start_or_fail(request)
                    if len(self.batch):
                        finished += self._decode()
            except Exception as exc:
                log.exception("engine step failed")
                finished = self._fail_all(exc)
            with self._cv:
                done = self.scheduler.finish(finished)
                self._cv.notify_all()
            for request in done:
                self.adapters.release(request.adapter_name)
                request.deliver(request.completions())

    def _start_or_fail(self, request: Request) -> list[Sample]:
        try:
            return self._start(request)
        except Exception as exc:  # e.g. a checkpoint that vanished: fail this request only
            log.warning("request %d failed at prefill: %s", request.id, exc)
            request.deliver(exc)
            request.deliver = lambda result: None
            return list(request.samples)

    def _start(self, request: Request) -> list[Sample]:
        """Prefill after the cached prefix, sample every first token, join the batch."""
        request.adapter_name, request.served_step = self.adapters.acquire(request.adapter)
        weights = _weights_key(request.adapter_name, request.served_step)
        prefix_len, prefix_kv = self.prefix_cache.longest(weights, request.prompt)
        logits, kv = self.runner.prefill(request.prompt, prefix_len, prefix_kv, request.adapter_name)
        self.prefix_cache.put(weights, request.prompt, kv)
        samples = request.samples
        finished = self._advance(samples, logits.expand(len(samples), -1))
        live = [s for s in samples if s not in finished]
        if live:
            self.batch.add(live, [(k.expand(len(live), -1, -1, -1), v.expand(len(live), -1, -1, -1)) for k, v in kv])
        return finished

    def _decode(self) -> list[Sample]:
        ids, mask, positions = self.batch.step_inputs()
        names = [s.request.adapter_name for s in self.batch.rows]
        logits = self.runner.forward(ids, mask, positions, self.batch.cache, names)
        self.steps += 1
        finished = self._advance(self.batch.rows, logits)
        if finished:
            done = set(map(id, finished))
            self.batch.keep([i for i, s in enumerate(self.batch.rows) if id(s) not in done])
        return finished

    def _advance(self, samples: list[Sample], logits: torch.Tensor) -> list[Sample]:
        """Append one sampled token to each sample; return those that just finished."""
        tokens, logprobs, top = sample_next(logits, [s.params for s in samples], [s.generator for s in samples])
        finished = []
        for sample, token, logprob, alternatives in zip(samples, tokens.tolist(), logprobs.tolist(), top):
            sample.ids.append(token)
            sample.logprobs.append(logprob)
            if sample.params.top_logprobs:
                sample.top.append(alternatives)
            if self._finish_reason(sample):
                finished.append(sample)
        return finished

    def _finish_reason(self, sample: Sample) -> str | None:
        result = self.stopping.check(sample.params, len(sample.request.prompt), sample.ids)
        if result is not None:
            sample.finish_reason, sample.text = result
        return sample.finish_reason

    def _fail_all(self, exc: Exception) -> list[Sample]:
        """Answer every running request with the error and start from an empty batch."""
        failed = list(self.scheduler.running)
        requests = {id(s.request): s.request for s in failed}.values()
        for request in requests:
            request.deliver(exc)
            request.deliver = lambda result: None
        self.batch = RunningBatch(self.model.config)
        return failed


def _weights_key(adapter_name: str, step: int | None) -> str:
    return f"{adapter_name}@{step}" if adapter_name == LIVE else adapter_name


def _kv_bytes_per_token(config) -> int:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * 4
