"""The engine: continuous batching, shared prefixes and mixed adapters in one batch, CPU or CUDA.

`step()` is one synchronous iteration, as in nano-vllm: admit waiting requests at the step
boundary (scheduler), prefill them after their longest cached prefix (prefix cache) and sample
each sample's first token, decode one token for every running row (runner), retire the rows
that finished. A thin driver thread runs `step()` while there is work and answers requests
when all their samples finish (every such thread is stopped at interpreter exit:
`stop_all_engines`); `generate()` is the async face. It knows nothing about HTTP,
chat formats or GRPO.

The runner (`art.engine.runner.Runner`) does the tensor work: `StaticRunner` (the engine's own
decoder, static shapes, CUDA graphs) for Llama-family models, `HFRunner` (transformers' forward)
for the rest.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from art.engine.adapters import LIVE, AdapterSet
from art.engine.base import AdapterRef, Completion, FinishReason, ManagedEngine, SampledTokens, SamplingParams
from art.engine.config import EngineConfig
from art.engine.decoder import unsupported_reason
from art.engine.grammar import Grammars, consume
from art.engine.hf_runner import HFRunner, kv_heads_and_dim
from art.engine.prefix_cache import PrefixCache
from art.engine.runner import Runner
from art.engine.sampling import make_generator, sample_next
from art.engine.scheduler import Scheduler
from art.engine.sequence import Request, Sample
from art.engine.static_runner import StaticRunner
from art.engine.stopping import IncrementalText, StopChecker
from art.errors import BackendUnavailableError
from art.weights import is_peft

log = logging.getLogger(__name__)

TTFT_WINDOW = 256
"""Requests whose time to first token /health summarises (the latest ones)."""

_RUNNING: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
"""Engines whose thread has not been stopped: `stop_all_engines` stops them."""


class LLMEngine(ManagedEngine):
    """Implements `art.engine.base.ManagedEngine`.

    `config` or vLLM-named keyword arguments (`LLMEngine(model, tokenizer, max_num_seqs=8)`)
    set it up. The model is already loaded: "auto" device and dtype mean its own."""

    kind = "ours"

    def __init__(
        self,
        model,
        tokenizer,
        config: EngineConfig | None = None,
        *,
        lock: threading.RLock | None = None,
        adapters: AdapterSet | None = None,
        **engine_args,
    ) -> None:
        if config is not None and engine_args:
            raise TypeError("pass either an EngineConfig or engine keyword arguments, not both")
        self.config = config = (config or EngineConfig.from_engine_args(engine_args)).resolve(model)
        self.model = model
        self.tokenizer = tokenizer
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.lock = lock or threading.RLock()
        self.adapters = adapters or AdapterSet(model)
        self.adapters.max_loaded = config.max_loaded_adapters
        reason = unsupported_reason(model)
        # Any: the engine hands a prefill's staged prompts back to the runner that made them, unread.
        self.runner: Runner[Any]
        if reason is None:
            self.runner = StaticRunner(model, self.adapters, config, self.max_model_len)
        else:
            log.info("serving through transformers' forward (no static shapes or CUDA graphs): %s", reason)
            self.runner = HFRunner(model, self.adapters, config, self.max_model_len)
        self.scheduler = Scheduler(
            max_num_seqs=self.runner.max_rows,
            max_kv_tokens=self._kv_tokens(),
            row_width=self.runner.row_width,
            max_model_len=self.max_model_len,
        )
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens)
        self.rows: list[Sample] = []
        """The running samples; row i is row i of the runner's batch."""
        self.stopping = StopChecker(model, tokenizer, self.max_model_len)
        self.eos_ids = self.stopping.eos_ids
        self.grammars = Grammars(tokenizer, model.config.vocab_size, self.stopping.eos_ids)
        self.steps = 0
        self.prompt_tokens = 0
        """Prompt tokens of all admitted requests (compare runner.prefill_computed_tokens)."""
        self.progress_at = time.monotonic()
        """When the loop last finished a step, or work reached an idle engine (`stalled_s`)."""
        self.recent_ttft_s: deque[float] = deque(maxlen=TTFT_WINDOW)
        """Seconds from arrival to first token of the latest requests (/health's TTFT)."""
        self._cv = threading.Condition()
        self._stopped = False
        self._threads: int | None = None
        """torch threads the engine thread should use (None: the process default); `set_threads`."""
        self._thread = threading.Thread(target=self._loop, name="art-engine", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def _kv_tokens(self) -> int:
        """The scheduler's KV budget in positions: on CUDA the cache's (rows x the width of the
        longest must fit in it); on the CPU kv_cache_bytes bounds the sum over running samples of
        prompt + max_tokens."""
        if self.runner.row_width is not None:  # a fixed layout (CUDA's)
            return self.runner.kv_positions
        heads, head_dim = kv_heads_and_dim(self.model.config)
        element = self.config.torch_dtype.itemsize
        return self.config.kv_cache_bytes // (2 * self.model.config.num_hidden_layers * heads * head_dim * element)

    # -- API --------------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> list[Completion]:
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

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the caller's loop is closed: nobody waits for the answer
                pass

        self._submit(Request(list(prompt_token_ids), params, adapter, deliver))
        return await future

    async def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> AsyncGenerator[SampledTokens | list[Completion], None]:
        """`generate`, yielding each completion's tokens as soon as a step samples them, then the
        completions. A caller that stops listening does not stop the request: it runs to its end."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody listens any more
                pass

        self._submit(Request(list(prompt_token_ids), params, adapter, put, on_tokens=put))
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item and isinstance(item[0], Completion):
                yield item
                return
            for tokens in item:
                yield tokens

    def _submit(self, request: Request) -> None:
        request.samples = [Sample(request, i, make_generator(request.params.seed, i)) for i in range(request.params.n)]
        with self._cv:
            if self._stopped:
                raise BackendUnavailableError("the engine is stopped (backend closed)")
            if self.scheduler.idle:
                self.progress_at = time.monotonic()
            self.scheduler.add(request)  # raises ArtValueError for what could never fit
            self._cv.notify_all()

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
        return time.monotonic() - self.progress_at if self.has_work() and not self._stopped else 0.0

    @property
    def serves_while_training(self) -> bool:
        """Whether a training step may run beside this engine (`serving_while_training`): a LoRA
        adapter, decoded by a runner that reads only its own copies of the live weights."""
        return self.runner.serves_while_training and is_peft(self.model)

    @contextmanager
    def serving_while_training(self, threads: int | None = None) -> Iterator[None]:
        """The caller's thread trains the live adapter meanwhile: the engine goes on serving the
        last published weights (its own copies, taken now) until `weights_updated` publishes the
        new ones. peft's module tree is frozen meanwhile: a request for a checkpoint that is not
        loaded yet waits for the step to end. `threads`: the engine thread's torch threads
        meanwhile (on the CPU the trainer takes the other cores; None keeps them)."""
        if not self.serves_while_training:
            raise RuntimeError("this engine reads the trained modules themselves: pause it for a weight update")
        with self.lock:
            self.runner.refresh()
            self._sync_streams()
            self.adapters.frozen = True
        self.set_threads(threads)
        try:
            yield
        finally:
            self.set_threads(None)
            with self._cv:
                self.adapters.frozen = False
                self._cv.notify_all()  # deferred requests may run now

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
                self.runner.idle()  # a CPU engine hands its KV memory to the trainer
                yield
        finally:
            with self._cv:
                self.scheduler.paused = False
                self.progress_at = time.monotonic()  # what waited meanwhile is not a stall
                self._cv.notify_all()

    def weights_updated(self, step: int, checkpoint: Path | None = None) -> None:
        """The live weights now hold `step`: publish them (they are in the shared model already,
        so `checkpoint` is not read). Requests admitted from now on sample
        with them; rows still decoding on the previous publication finish on it (its copies are
        kept under a retired name). An engine that does not serve while training is paused."""
        with self.lock:
            previous = self.adapters.live_step
            self.adapters.unmerge()
            in_flight = previous != step and any(
                s.request.adapter_name == LIVE and s.request.served_step == previous for s in self.rows
            )
            self.runner.weights_changed(
                all_weights=not is_peft(self.model), retire=retired_name(previous) if in_flight else None
            )
            self.prefix_cache.drop(f"{LIVE}@{previous}")
            self.adapters.live_step = step
            if self.serves_while_training:  # copy now: the next training step writes the live tensors
                self.runner.refresh()
                self._sync_streams()

    def _sync_streams(self) -> None:
        """On CUDA the engine thread decodes on a stream of its own: what another thread's stream
        just copied into the served weights must be done before the engine reads it, and the
        engine's reads of the old values before that thread writes more."""
        if self.config.on_cuda:
            torch.cuda.synchronize(torch.device(self.config.device))

    def stats(self) -> dict:
        return {
            "engine/kind": self.kind,
            "engine/queue_depth": self.queue_depth,
            "engine/running": self.running,
            "engine/decode_steps": self.steps,
            "engine/prefix_cache_hits": self.prefix_cache.hits,
            "engine/prefix_cache_reused_tokens": self.prefix_cache.reused_tokens,
            **_ttft_stats(list(self.recent_ttft_s)),
            **self.runner.stats(),
        }

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One iteration: admit, prefill the admitted, decode the running, retire the finished.
        Returns the requests completed by it (their completions are ready to deliver)."""
        with self._cv:
            admitted = self.scheduler.admit(self._waits_for_training)
        try:
            with self.lock, torch.inference_mode():
                finished = self._start(admitted)
                if self.rows:
                    finished += self._decode()
                self._forget_retired()
        except Exception as exc:
            log.exception("engine step failed")
            finished = self._fail_all(exc)
        with self._cv:
            done = self.scheduler.finish(finished)
            self.progress_at = time.monotonic()
            self._cv.notify_all()
        for request in done:
            self.adapters.release(request.adapter_name)
        return done

    def has_work(self) -> bool:
        scheduler = self.scheduler
        if scheduler.running:
            return True
        if not scheduler.waiting or scheduler.paused:
            return False
        if not self.adapters.frozen:
            return True
        try:  # while a step trains, requests for checkpoints not loaded yet wait: not work now
            return scheduler.admissible(self._waits_for_training)
        except RuntimeError:  # the queue changed under a reader without the lock (the watchdog)
            return True

    def _waits_for_training(self, request: Request) -> bool:
        return self.adapters.must_wait(request.adapter)

    def _route_name(self, request: Request) -> str:
        """The weights a request's rows decode with: its adapter's, or for live rows admitted
        before the latest publication, that publication's retired copies."""
        if request.adapter_name == LIVE and request.served_step != self.adapters.live_step:
            return retired_name(request.served_step)
        return request.adapter_name

    def _forget_retired(self) -> None:
        """Drop the retired publications no running row decodes on any more."""
        retired = self.runner.retired()
        if retired:
            for name in retired - {self._route_name(s.request) for s in self.rows}:
                self.runner.forget(name)

    # -- driver thread ------------------------------------------------------------------------
    def stop(self) -> None:
        """End the engine thread (after the step it is in); requests still waiting or running get
        a BackendUnavailableError."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        _RUNNING.discard(self)

    def set_threads(self, threads: int | None) -> None:
        """torch threads for the engine thread from its next step on (None: the process default).
        On the CPU a training step that runs beside the engine takes the other cores."""
        self._threads = threads

    def _loop(self) -> None:
        if self.config.on_cuda:  # a new thread starts on device 0; the engine's work is on its own
            device = torch.device(self.config.device)
            torch.cuda.set_device(device)
            # A stream of its own: the kernels a training step queues beside the engine
            # (`serving_while_training`) go to the trainer thread's stream, and a decode step
            # would otherwise wait behind all of them. It starts after what built the engine.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            torch.cuda.set_stream(stream)
        default, applied = torch.get_num_threads(), None
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or self.has_work())
                if self._stopped:
                    self._abandon()
                    return
            wanted = self._threads or default
            if wanted != applied:  # per thread under OpenMP: the trainer's thread keeps its own
                torch.set_num_threads(wanted)
                applied = wanted
            for request in self.step():
                request.deliver(request.completions())

    def _start(self, requests: list[Request]) -> list[Sample]:
        """Prefill the admitted requests after their cached prefixes, sample every first
        token, and let the unfinished samples join the running batch."""
        ready, finished = [], []
        admitted = time.monotonic()
        for request in requests:
            if self.adapters.must_wait(request.adapter):  # a training step began since admission
                with self._cv:
                    self.scheduler.requeue(request)
                continue
            request.admitted_at = admitted
            try:
                if request.params.grammar:  # one compile; the samples' matchers are copies
                    first = self.grammars.matcher(request.params.grammar)
                    for sample in request.samples:
                        sample.matcher = first if sample.index == 0 else first.deep_copy()
                request.adapter_name, request.served_step = self.adapters.acquire(request.adapter)
                self.prompt_tokens += len(request.prompt)
                ready.append(request)
            except Exception as exc:  # e.g. a checkpoint that vanished: fail this request only
                log.warning("request %d failed: %s", request.id, exc)
                _fail(request, exc)
                finished += request.samples
        self._share_common_prefix(ready)
        for chunk in _prefill_chunks(ready, self.config.prefill_tokens):
            rows = len(self.rows)
            try:
                finished += self._prefill(chunk)
            except Exception as exc:
                if len(self.rows) != rows:  # failed while joining the batch: the batch itself is suspect
                    raise
                # A prompt that failed to prefill (out of memory, say) fails its own requests only.
                log.exception("prefill of %d request(s) failed", len(chunk))
                for request in chunk:
                    _fail(request, exc)
                finished += [s for r in chunk for s in r.samples]
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
        logits, staged = self.runner.prefill(prompts, prefixes, adapters)
        for i, ((w, _), prompt) in enumerate(zip(keys, prompts)):
            if len(prompt) <= self.prefix_cache.max_tokens:
                self.prefix_cache.put(w, prompt, self.runner.prompt_kv(staged, i))
        samples = [s for r in requests for s in r.samples]
        row_of = [row_of_request[j] for j, r in enumerate(requests) for _ in r.samples]
        finished = self._advance(samples, logits[torch.tensor(row_of, device=logits.device)])
        first_token = time.monotonic()
        for r in requests:
            r.first_token_at = first_token
            self.recent_ttft_s.append(first_token - r.arrived_at)
        done = set(map(id, finished))
        live = [k for k, s in enumerate(samples) if id(s) not in done]
        if live:
            self.rows += [samples[k] for k in live]
            reach = [samples[k].request.reach(self.max_model_len) for k in live]
            self.runner.add(staged, [row_of[k] for k in live], reach)
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
            if len(common) - cached[0] < 16 or len(common) > self.prefix_cache.max_tokens:
                continue
            if self.runner.prefixes_whole:  # a state at the end of the common prefix itself
                _, staged = self.runner.prefill([common], [cached], [group[0].adapter_name])
                self.prefix_cache.put(weights, common, self.runner.prompt_kv(staged, 0))
                continue
            _, staged = self.runner.prefill([common + [0]], [cached], [group[0].adapter_name])
            keys, values = self.runner.prompt_kv(staged, 0)  # type: ignore[misc]  # keys and values: any prefix serves
            self.prefix_cache.put(weights, common, (keys[:, :, : len(common)], values[:, :, : len(common)]))

    def _decode(self) -> list[Sample]:
        rows = self.rows
        logits = self.runner.decode(
            [s.ids[-1] for s in rows], [s.position for s in rows], [self._route_name(s.request) for s in rows]
        )
        self.steps += 1
        finished = self._advance(rows, logits)
        if finished:
            done = set(map(id, finished))
            order = swap_remove([i for i, s in enumerate(rows) if id(s) in done], len(rows))
            self.runner.keep(order)
            self.rows = [rows[i] for i in order]
        return finished

    def _advance(self, samples: list[Sample], logits: torch.Tensor) -> list[Sample]:
        """Append one sampled token to each sample; return those that just finished."""
        tokens, logprobs, top = sample_next(
            logits, [s.params for s in samples], [s.generator for s in samples], self._allowed(samples, logits.device)
        )
        finished = []
        streamed: dict[int, tuple[Request, list[SampledTokens]]] = {}  # request id -> its samples' new tokens
        for sample, token, logprob, alternatives in zip(samples, tokens.tolist(), logprobs.tolist(), top):
            if sample.matcher is not None:
                consume(sample.matcher, token)
            sample.ids.append(token)
            sample.logprobs.append(logprob)
            if sample.params.top_logprobs:
                sample.top.append(alternatives)
            request = sample.request
            if request.on_tokens is not None:
                streamed.setdefault(request.id, (request, []))[1].append(
                    SampledTokens(
                        sample.index,
                        [token],
                        [logprob],
                        [alternatives] if sample.params.top_logprobs else [],
                        request.served_step,
                    )
                )
            if self._finish_reason(sample):
                finished.append(sample)
        for request, batch in streamed.values():  # one call per request and step, before its answer
            if request.on_tokens is not None:
                request.on_tokens(batch)
        return finished

    def _allowed(self, samples: list[Sample], device: torch.device) -> torch.Tensor | None:
        """The grammar mask of the batch on the logits' device (unconstrained rows allow
        everything), or None when no row is constrained."""
        constrained = [i for i, s in enumerate(samples) if s.matcher is not None]
        if not constrained:
            return None
        allowed = torch.ones(len(samples), self.grammars.vocab_size, dtype=torch.bool, device=device)
        allowed[torch.tensor(constrained, device=device)] = self.grammars.allowed(
            [samples[i].matcher for i in constrained], device
        )
        return allowed

    def _finish_reason(self, sample: Sample) -> FinishReason | None:
        if sample.params.stop and sample.text_so_far is None:
            sample.text_so_far = IncrementalText(self.tokenizer)
        result = self.stopping.check(sample.params, len(sample.request.prompt), sample.ids, sample.text_so_far)
        if result is not None:
            sample.finish_reason, sample.text = result
        return sample.finish_reason

    def _abandon(self) -> None:
        error = BackendUnavailableError("the engine was stopped (backend closed) before this request finished")
        requests = list(self.scheduler.waiting) + list(
            {id(s.request): s.request for s in self.scheduler.running}.values()
        )
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        for request in requests:
            request.deliver(error)
        self.rows = []
        self.runner.clear()

    def _fail_all(self, exc: Exception) -> list[Sample]:
        """Answer every running request with the error and start from an empty batch."""
        failed = list(self.scheduler.running)
        requests = {id(s.request): s.request for s in failed}.values()
        for request in requests:
            _fail(request, exc)
        self.rows = []
        self.runner.clear()
        return failed


@atexit.register
def stop_all_engines() -> None:
    """Stop every engine still running; at interpreter exit (an atexit hook) for a script that
    raised, or ended, with requests in flight. The engine thread is a daemon: left running, it
    would be inside a torch op when the interpreter finalizes, and a daemon thread that wakes up
    then is ended by `pthread_exit`, whose unwinding through torch's C++ frames aborts the
    process (`terminate called without an active exception`, exit 134) after the user's
    traceback. atexit hooks run before that, while every thread still runs normally."""
    for engine in list(_RUNNING):
        engine.stop()


def retired_name(step: int | None) -> str:
    """What rows decoding on an earlier publication of the live adapter call its weights."""
    return f"{LIVE}@{step}"


def _fail(request: Request, exc: BaseException) -> None:
    """Answer with the error now; the completion delivered when its samples retire is dropped."""
    request.deliver(exc)
    request.deliver = lambda result: None
    request.on_tokens = None


def _ttft_stats(seconds: list[float]) -> dict[str, float]:
    """Mean and median time to first token in ms of the latest requests; none before the first."""
    if not seconds:
        return {}
    return {
        "engine/ttft_ms_mean": 1000 * statistics.fmean(seconds),
        "engine/ttft_ms_p50": 1000 * statistics.median(seconds),
        "engine/ttft_requests": len(seconds),
    }


def swap_remove(finished: list[int], rows: int) -> list[int]:
    """The rows that stay, in slot order, after rows `finished` leave: each freed slot below the
    new end takes the last row still running, so at most one row moves per finished row (moving
    every later row down would copy O(rows x length) per finish)."""
    gone = set(finished)
    order = list(range(rows - len(gone)))
    tail = [j for j in range(len(order), rows) if j not in gone]  # survivors past the new end
    for slot in sorted(i for i in gone if i < len(order)):
        order[slot] = tail.pop()
    return order


def _prefill_chunks(requests: list[Request], max_tokens: int) -> list[list[Request]]:
    """Group requests so each prefill pass stays within about `max_tokens` padded tokens."""
    chunks: list[list[Request]] = []
    current: list[Request] = []
    longest = 0
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
