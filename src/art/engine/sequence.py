"""Request and sample state of the engine (plain Python, no torch).

A `Request` is one generate() call: a prompt, its sampling params and adapter; it owns
`params.n` `Sample`s, each one completion being decoded. The scheduler moves samples through
WAITING -> RUNNING -> FINISHED; the request is answered when all its samples are finished.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from art.engine.base import AdapterRef, Completion, FinishReason, SampledTokens, SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    adapter: AdapterRef | None
    deliver: Callable[[Any], None]
    """Called once, from the engine thread, with list[Completion] or an exception."""
    on_tokens: Callable[[list[SampledTokens]], None] | None = None
    """A streamed request's listener: called from the engine thread after each step that sampled
    its tokens, once with all of them."""
    id: int = field(default_factory=lambda: next(_ids))
    samples: list[Sample] = field(default_factory=list)
    served_step: int | None = None
    adapter_name: str = "__base__"
    """The peft adapter name its samples decode with (set at admission)."""
    arrived_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None

    @property
    def kv_tokens(self) -> int:
        """KV-cache tokens reserved while it runs: every sample at its longest."""
        return self.params.n * (len(self.prompt) + self.params.max_tokens)

    def reach(self, max_model_len: int | None) -> int:
        """The length its rows may grow to: prompt + max_tokens, within the context."""
        end = len(self.prompt) + self.params.max_tokens
        return end if max_model_len is None else min(end, max_model_len)

    def completions(self) -> list[Completion]:
        out = [s.completion() for s in self.samples]
        for completion in out:
            if self.admitted_at is not None:
                completion.queue_s = self.admitted_at - self.arrived_at
            if self.first_token_at is not None:
                completion.time_to_first_token_s = self.first_token_at - self.arrived_at
        return out


@dataclass(eq=False)
class Sample:
    request: Request
    index: int
    generator: Any = None
    """torch.Generator of this sample (seeded from the request's seed and index)."""
    matcher: Any = None
    """The grammar matcher of a constrained sample (`art.engine.grammar`); None: unconstrained."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text_so_far: Any = None
    """Its text decoded incrementally, for stop strings (`stopping.IncrementalText`)."""
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    text: str = ""

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def position(self) -> int:
        """Position id of the next input token (the last sampled one)."""
        return len(self.request.prompt) + len(self.ids) - 1

    def completion(self) -> Completion:
        return Completion(
            self.ids, self.logprobs, self.text, self.finish_reason or "length", self.top, step=self.request.served_step
        )
