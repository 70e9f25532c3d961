"""Which requests run next: FIFO admission under a sequence and KV-token budget.

Plain Python, no torch. Requests join the running batch only at step boundaries (the engine
calls `admit` between decode steps) and leave when all their samples finish. A request that
could never fit is refused when added; one that does not fit *now* waits in order.

The KV budget is counted one of two ways. By default a request holds n x (prompt + max_tokens)
positions (a CPU cache, where rows are only as long as they are). With `row_width`, every
running row holds the width of the longest one at its end (a CUDA cache, where every slot has
one stride): the batch needs rows x row_width(longest).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from art.engine.sequence import Request, Sample, Status
from art.errors import ArtValueError


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_kv_tokens: int,
        row_width: Callable[[int], int] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_kv_tokens = max_kv_tokens
        self.row_width = row_width
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Sample] = []
        self.reserved_tokens = 0
        self.paused = False
        """While paused nothing is admitted (a training step is about to change weights)."""

    def check(self, request: Request) -> None:
        """Refuse what could never run, with the field to change."""
        if request.params.n > self.max_num_seqs:
            raise ArtValueError(
                f"n={request.params.n} exceeds the engine's max_num_seqs={self.max_num_seqs}", field="n"
            )
        if self._needed(request.params.n, request.kv_tokens, self._end(request)) > self.max_kv_tokens:
            raise ArtValueError(
                f"n x (prompt + max_tokens) = {request.kv_tokens} tokens exceeds the engine's KV budget of "
                f"{self.max_kv_tokens}{' (every row holds the width of the longest)' if self.row_width else ''}; "
                "lower n or max_tokens",
                field="max_tokens",
            )

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    def admit(self, defer: Callable[[Request], bool] | None = None) -> list[Request]:
        """Pop, in order, the waiting requests that fit beside the running ones. Requests that
        `defer` names stay waiting, in place, and do not hold back those behind them."""
        admitted: list[Request] = []
        deferred: list[Request] = []
        while self.waiting and not self.paused:
            request = self.waiting[0]
            if defer is not None and defer(request):
                deferred.append(self.waiting.popleft())
                continue
            if len(self.running) + request.params.n > self.max_num_seqs:
                break
            needed = self._needed(
                len(self.running) + request.params.n,
                self.reserved_tokens + request.kv_tokens,
                max(self._longest(), self._end(request)),
            )
            if needed > self.max_kv_tokens:
                break
            self.waiting.popleft()
            self.reserved_tokens += request.kv_tokens
            for sample in request.samples:
                sample.status = Status.RUNNING
            self.running.extend(request.samples)
            admitted.append(request)
        self.waiting.extendleft(reversed(deferred))
        return admitted

    def admissible(self, defer: Callable[[Request], bool] | None = None) -> bool:
        """Whether some waiting request could be admitted now (not paused, not deferred)."""
        return not self.paused and any(defer is None or not defer(r) for r in self.waiting)

    def requeue(self, request: Request) -> None:
        """Undo the admission of `request` (nothing of it has run): it waits first in line."""
        ids = set(map(id, request.samples))
        self.running = [s for s in self.running if id(s) not in ids]
        self.reserved_tokens -= request.kv_tokens
        for sample in request.samples:
            sample.status = Status.WAITING
        self.waiting.appendleft(request)

    def finish(self, samples: list[Sample]) -> list[Request]:
        """Drop finished samples from the batch; return the requests now complete."""
        done = set(map(id, samples))
        for sample in samples:
            sample.status = Status.FINISHED
        self.running = [s for s in self.running if id(s) not in done]
        complete = []
        for request in {id(s.request): s.request for s in samples}.values():
            if all(s.status is Status.FINISHED for s in request.samples):
                self.reserved_tokens -= request.kv_tokens
                complete.append(request)
        return complete

    def _end(self, request: Request) -> int:
        return request.reach(self.max_model_len)

    def _longest(self) -> int:
        return max((self._end(s.request) for s in self.running), default=0)

    def _needed(self, rows: int, tokens: int, longest: int) -> int:
        return rows * self.row_width(longest) if self.row_width else tokens

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
