"""A plain, correct batched sampler on PyTorch + transformers (the CPU default for now).

Concurrent requests are collected by one worker thread and decoded together: each distinct
prompt is prefilled once (the `n` samples of a request share it), the KV cache is then
gathered out to one row per sample, and finished rows leave the batch. Logprobs are those of
the raw model distribution (temperature 1), the quantity the trainer recomputes.
It does not know about HTTP, chat formats or training.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import random
import threading
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from art.engine.adapters import AdapterSwitcher
from art.engine.base import AdapterRef, Completion, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Job:
    prompt: list[int]
    params: SamplingParams
    adapter: AdapterRef | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Row:
    """One completion being decoded."""

    job: int
    params: SamplingParams
    generator: torch.Generator
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None
    text: str = ""


class TorchSampler:
    """Implements `art.engine.base.Engine` with a worker thread and a shared model lock."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_model_len: int | None = None,
        max_batch_size: int = 64,
        lock: threading.RLock | None = None,
        adapters: AdapterSwitcher | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len or limit, limit)
        self.max_batch_size = max_batch_size
        self.lock = lock or threading.RLock()
        self.adapters = adapters or AdapterSwitcher(model)
        self.eos_ids = _eos_ids(model, tokenizer)
        self._cache_kw = _cache_keyword(model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.queue_depth = 0
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="art-sampler", daemon=True)
        self._worker.start()

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterRef | None
    ) -> list[Completion]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue_depth += 1
        self._queue.put(_Job(list(prompt_token_ids), params, adapter, loop, future))
        return await future

    # -- worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while True:  # take whatever else is already waiting
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            by_adapter: dict[str | None, list[_Job]] = {}
            for job in jobs:
                by_adapter.setdefault(job.adapter.key if job.adapter else None, []).append(job)
            for group in by_adapter.values():
                for batch in _split(group, self.max_batch_size):
                    self._serve(batch)

    def _serve(self, jobs: list[_Job]) -> None:
        try:
            with self.lock, self.adapters.use(jobs[0].adapter), torch.inference_mode():
                results = self.sample(jobs)
        except BaseException as exc:  # report to every caller; the worker keeps running
            log.exception("sampling failed")
            for job in jobs:
                self._resolve(job, exc=exc)
            return
        for job, completions in zip(jobs, results):
            self._resolve(job, completions)

    def _resolve(self, job: _Job, result=None, exc: BaseException | None = None) -> None:
        self.queue_depth -= 1

        def settle() -> None:
            if job.future.done():
                return
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)

        job.loop.call_soon_threadsafe(settle)

    # -- tensor work ---------------------------------------------------------------------
    def sample(self, jobs: list[_Job]) -> list[list[Completion]]:
        """Decode every sample of every job in one batch; the active adapter is already set."""
        rows = [
            _Row(j, job.params, _generator(job.params.seed, i))
            for j, job in enumerate(jobs)
            for i in range(job.params.n)
        ]
        cache = DynamicCache(config=self.model.config)
        logits, mask = self._prefill([job.prompt for job in jobs], cache)  # [jobs, vocab], [jobs, T]
        index = torch.tensor([row.job for row in rows])
        cache.batch_select_indices(index)
        logits, mask = logits[index], mask[index]
        positions = torch.tensor([len(jobs[row.job].prompt) for row in rows])
        active = list(range(len(rows)))
        while active:
            chosen = self._pick(logits, [rows[r] for r in active])  # [active]
            still = []
            for k, r in enumerate(active):
                if self._finished(rows[r]) is None:
                    still.append(k)
            if not still:
                break
            keep = torch.tensor(still)
            if len(still) < len(active):
                cache.batch_select_indices(keep)
                mask, positions, chosen = mask[keep], positions[keep], chosen[keep]
                active = [active[k] for k in still]
            mask = torch.cat([mask, torch.ones(len(active), 1, dtype=mask.dtype)], dim=1)
            out = self.model(
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=positions[:, None],
                use_cache=True,
                **{self._cache_kw: cache},
            )
            logits = out.logits[:, -1, :].float()
            positions = positions + 1
        results: list[list[Completion]] = [[] for _ in jobs]
        for row in rows:
            results[row.job].append(
                Completion(row.ids, row.logprobs, row.text, row.finish or "length", row.top)
            )
        return results

    def _prefill(self, prompts: list[list[int]], cache: DynamicCache):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every last token at the end
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids,
            use_cache=True, logits_to_keep=1, **{self._cache_kw: cache},
        )
        return out.logits[:, -1, :].float(), mask

    def _pick(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Sample one token per row; record its raw logprob (and top alternatives)."""
        logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
        chosen = torch.empty(len(rows), dtype=torch.long)
        for i, row in enumerate(rows):
            p = row.params
            if p.temperature == 0:
                token = int(torch.argmax(logprobs[i]))
            else:
                probs = torch.softmax(logits[i] / p.temperature, dim=-1)
                if p.top_p < 1.0:
                    probs = _top_p(probs, p.top_p)
                token = int(torch.multinomial(probs, 1, generator=row.generator))
            chosen[i] = token
            row.ids.append(token)
            row.logprobs.append(float(logprobs[i, token]))
            if p.top_logprobs:
                values, tokens = torch.topk(logprobs[i], p.top_logprobs)
                row.top.append(list(zip(tokens.tolist(), values.tolist())))
        return chosen

    def _finished(self, row: _Row) -> str | None:
        """Set and return the finish reason once a row is done."""
        if row.ids[-1] in self.eos_ids and not row.params.ignore_eos:
            row.finish = "stop"
            row.text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
        elif row.params.stop and (cut := self._stop_cut(row)) is not None:
            row.finish = "stop"
            row.text = cut
        elif len(row.ids) >= row.params.max_tokens:
            row.finish = "length"
            row.text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
        return row.finish

    def _stop_cut(self, row: _Row) -> str | None:
        # Only the tail can hold a new match: decode a window wide enough for the longest stop.
        text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
        tail_from = max(0, len(text) - max(len(s) for s in row.params.stop) - 16)
        best = None
        for s in row.params.stop:
            at = text.find(s, tail_from)
            if at >= 0 and (best is None or at < best):
                best = at
        return None if best is None else text[:best]


def _split(jobs: list[_Job], max_rows: int) -> list[list[_Job]]:
    batches, current, rows = [], [], 0
    for job in jobs:
        if current and rows + job.params.n > max_rows:
            batches.append(current)
            current, rows = [], 0
        current.append(job)
        rows += job.params.n
    if current:
        batches.append(current)
    return batches


def _generator(seed: int | None, sample: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(random.getrandbits(63) if seed is None else (seed * 1_000_003 + sample) % (2**63))
    return g


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest set reaching top_p
    sorted_probs[drop] = 0.0
    out = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return out / out.sum()


def _cache_keyword(model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; accept both."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
