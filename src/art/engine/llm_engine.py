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
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from art.engine.adapters import LIVE, AdapterSet
from art.engine.base import AdapterRef, Completion, SamplingParams
from art.engine.model_runner import ModelRunner, RunningBatch, kv_heads_and_dim
from art.engine.prefix_cache import PrefixCache
from art.engine.sampling import make_generator, sample_next
from art.engine.scheduler import Scheduler
from art.engine.sequence import Request, Sample
from art.engine.stopping import StopChecker
from art.errors import ArtValueError, BackendUnavailableError

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
        prefill_tokens: int = 4096,
    ) -> None:
        _check_limits(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes,
                      prefix_cache_tokens=prefix_cache_tokens, prefill_tokens=prefill_tokens)
        self.model = model
        self.tokenizer = tokenizer
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len or limit, limit)
        self.lock = lock or threading.RLock()
        self.adapters = adapters or AdapterSet(model)
        self.runner = ModelRunner(model, self.adapters)
        self.scheduler = Scheduler(max_num_seqs=max_num_seqs, max_kv_tokens=kv_cache_bytes // _kv_bytes_per_token(model.config))
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.prefill_tokens = prefill_tokens
        """Padded prompt tokens per prefill pass (bounds its memory)."""
        self.batch = RunningBatch(model.config)
        self.stopping = StopChecker(model, tokenizer, self.max_model_len)
        self.steps = 0
        self.prompt_tokens = 0
        """Prompt tokens of all admitted requests (compare runner.prefill_computed_tokens)."""
        self.progress_at = time.monotonic()
        """When the loop last finished a step, or work reached an idle engine (`stalled_s`)."""
        self._cv = threading.Condition()
        self._stopped = False
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
            if self._stopped:
                raise BackendUnavailableError("the engine is stopped (backend closed)")
            if self.scheduler.idle:
                self.progress_at = time.monotonic()
            self.scheduler.add(request)  # raises ArtValueError for what could never fit
            self._cv.notify_all()
        return await future

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def thread_id(self) -> int | None:
        """The engine thread's id (a watchdog reads its stack with `sys._current_frames`)."""
        return self._thread.ident

    def stalled_s(self) -> float:
        """Seconds without progress while there is work the loop could do; 0 when it has none.
        Requests held back while a weight update pauses the engine are not the loop's stall.
        Reads without the lock: a watchdog must not wait on what it watches."""
        scheduler = self.scheduler
        pending = bool(scheduler.running) or (bool(scheduler.waiting) and not scheduler.paused)
        return time.monotonic() - self.progress_at if pending and not self._stopped else 0.0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop admitting, let running requests finish, then hold the model lock (for a
        weight update). Requests that arrive meanwhile wait and run on the new weights."""
        with self._cv:
            self.scheduler.paused = True
            self._cv.wait_for(lambda: not self.scheduler.running)
        try:
            with self.lock:
                self.adapters.unmerge()  # the weights about to change must be the exact base + LoRA
                yield
        finally:
            with self._cv:
                self.scheduler.paused = False
                self.progress_at = time.monotonic()  # what waited meanwhile is not a stall
                self._cv.notify_all()

    def weights_updated(self, step: int) -> None:
        """The live adapter now holds `step` (called inside `paused()`)."""
        self.adapters.unmerge()
        self.prefix_cache.drop(f"{LIVE}@{self.adapters.live_step}")
        self.adapters.live_step = step

    # -- engine thread ----------------------------------------------------------------------
    def stop(self) -> None:
        """End the engine thread; requests still waiting or running get a BackendUnavailableError."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or self.scheduler.running
                                  or (self.scheduler.waiting and not self.scheduler.paused))
                if self._stopped:
                    self._abandon()
                    return
                admitted = self.scheduler.admit()
            try:
                with self.lock, torch.inference_mode():
                    finished = []
                    finished += self._start(admitted)
                    if len(self.batch):
                        finished += self._decode()
            except Exception as exc:
                log.exception("engine step failed")
                finished = self._fail_all(exc)
            with self._cv:
                done = self.scheduler.finish(finished)
                self.progress_at = time.monotonic()
                self._cv.notify_all()
            for request in done:
                self.adapters.release(request.adapter_name)
                request.deliver(request.completions())

    def _start(self, requests: list[Request]) -> list[Sample]:
        """Prefill the admitted requests after their cached prefixes, sample every first
        token, and let the unfinished samples join the running batch."""
        ready, finished = [], []
        self.prompt_tokens += sum(len(r.prompt) for r in requests)
        for request in requests:
            try:
                request.adapter_name, request.served_step = self.adapters.acquire(request.adapter)
                ready.append(request)
            except Exception as exc:  # e.g. a checkpoint that vanished: fail this request only
                log.warning("request %d failed: %s", request.id, exc)
                _fail(request, exc)
                finished += request.samples
        self._share_common_prefix(ready)
        for chunk in _prefill_chunks(ready, self.prefill_tokens):
            finished += self._prefill(chunk)
        return finished

    def _prefill(self, requests: list[Request]) -> list[Sample]:
        # Identical prompts on the same weights (a GRPO group sent as separate requests) are
        # computed once; every sample of every request then gets its own first token.
        unique: dict[tuple[str, tuple[int, ...]], int] = {}
        row_of_request, adapters = [], []
        for r in requests:
            key = (_weights_key(r.adapter_name, r.served_step), tuple(r.prompt))
            if key not in unique:
                unique[key] = len(unique)
                adapters.append(r.adapter_name)
            row_of_request.append(unique[key])
        keys = list(unique)
        prompts = [list(prompt) for _, prompt in keys]
        prefixes = [self.prefix_cache.longest(w, p) for (w, _), p in zip(keys, prompts)]
        logits, kv, mask = self.runner.prefill(prompts, prefixes, adapters)
        for i, ((w, _), prompt) in enumerate(zip(keys, prompts)):
            columns = mask[i].nonzero().squeeze(1)  # this prompt's kv without padding
            self.prefix_cache.put(w, prompt, [(k[i:i + 1, :, columns], v[i:i + 1, :, columns]) for k, v in kv])
        samples = [s for r in requests for s in r.samples]
        row_of = torch.tensor([row_of_request[j] for j, r in enumerate(requests) for _ in r.samples])
        finished = self._advance(samples, logits[row_of])
        done = set(map(id, finished))
        live = [k for k, s in enumerate(samples) if id(s) not in done]
        if live:
            index = row_of[live]
            self.batch.add([samples[k] for k in live], [(k[index], v[index]) for k, v in kv], mask[index])
        return finished

    def _share_common_prefix(self, requests: list[Request]) -> None:
        """Prefill once the prefix all these prompts share (a system prompt, a tool list) when
        it is not cached yet, so the batched prefill that follows reuses it."""
        by_weights: dict[str, list[Request]] = {}
        for r in requests:
            by_weights.setdefault(_weights_key(r.adapter_name, r.served_step), []).append(r)
        for weights, group in by_weights.items():
            prompts = {tuple(r.prompt) for r in group}
            if len(prompts) < 2:
                continue
            common = _common_prefix(list(prompts))
            cached = self.prefix_cache.longest(weights, common)
            if len(common) - cached[0] < 16:
                continue
            _, kv, _ = self.runner.prefill([common + [0]], [cached], [group[0].adapter_name])
            self.prefix_cache.put(weights, common, [(k[:, :, :len(common)], v[:, :, :len(common)]) for k, v in kv])

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

    def _abandon(self) -> None:
        error = BackendUnavailableError("the engine was stopped (backend closed) before this request finished")
        requests = list(self.scheduler.waiting) + list({id(s.request): s.request for s in self.scheduler.running}.values())
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        for request in requests:
            request.deliver(error)
        self.batch = RunningBatch(self.model.config)

    def _fail_all(self, exc: Exception) -> list[Sample]:
        """Answer every running request with the error and start from an empty batch."""
        failed = list(self.scheduler.running)
        requests = {id(s.request): s.request for s in failed}.values()
        for request in requests:
            _fail(request, exc)
        self.batch = RunningBatch(self.model.config)
        return failed


def _fail(request: Request, exc: BaseException) -> None:
    """Answer with the error now; the completion delivered when its samples retire is dropped."""
    request.deliver(exc)
    request.deliver = lambda result: None


def _prefill_chunks(requests: list[Request], max_tokens: int) -> list[list[Request]]:
    """Group requests so each prefill pass stays within about `max_tokens` padded tokens."""
    chunks, current, longest = [], [], 0
    for request in sorted(requests, key=lambda r: len(r.prompt)):
        longest_if_added = max(longest, len(request.prompt))
        if current and longest_if_added * (len(current) + 1) > max_tokens:
            chunks.append(current)
            current, longest_if_added = [], len(request.prompt)
        current.append(request)
        longest = longest_if_added
    if current:
        chunks.append(current)
    return chunks


def _common_prefix(prompts: list[tuple[int, ...]]) -> list[int]:
    shortest = min(prompts, key=len)
    for i, token in enumerate(shortest):
        if any(p[i] != token for p in prompts):
            return list(shortest[:i])
    return list(shortest)


def _weights_key(adapter_name: str, step: int | None) -> str:
    return f"{adapter_name}@{step}" if adapter_name == LIVE else adapter_name


def _kv_bytes_per_token(config) -> int:
    heads, head_dim = kv_heads_and_dim(config)
    return 2 * config.num_hidden_layers * heads * head_dim * 4  # keys and values, float32


def _check_limits(**limits) -> None:
    """Engine limits are positive ints (prefix_cache_tokens may be 0: no cache; max_model_len
    None: the model's own). A bad one would register a model that refuses every request."""
    problems = []
    for name, value in limits.items():
        if value is None and name == "max_model_len":
            continue
        minimum = 0 if name == "prefix_cache_tokens" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            problems.append((name, f"engine_args.{name} must be an int >= {minimum}, got {value!r}"))
    if problems:
        raise ArtValueError("; ".join(message for _, message in problems), field=f"engine_args.{problems[0][0]}")
