"""Running rollouts concurrently: each in its tracing span, failures kept as exception objects,
every end told to the reporter `art.gather` set, and the rest cancelled when one must stop them.

Kept apart from `art.trajectories` so that the data types stay data: `TrajectoryGroup` and
`art.gather` both await their rollouts through `run_rollouts`, and the pipeline trainer cancels
its workers with `cancel_all`. The module sits below `art.trajectories` and never imports it:
callers name the result type (`art.Trajectory`) a rollout must return, and the reporter takes
trajectories as opaque values (typed `Any`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

from .errors import TrajectoryError
from .observability import tracing

T = TypeVar("T")


class RolloutReporter(Protocol):
    """What `art.gather`'s progress is to the rollouts it runs: told how many to expect, then of
    each as it ends (it raises TooManyExceptionsError to stop them all)."""

    def expect(self, key: object, n: int) -> None: ...
    def record_trajectory(self, trajectory: Any) -> None: ...
    def record_exception(self, exception: BaseException) -> None: ...


ROLLOUT_REPORTER: ContextVar[RolloutReporter | None] = ContextVar("art_gather_reporter", default=None)
"""Set by `art.gather` so that groups awaited under it report each rollout as it finishes and
stop as soon as too many have raised."""


async def _run_one(item: Any, reporter: RolloutReporter | None, result_type: type[T]) -> T | BaseException:
    if isinstance(item, result_type):
        result: Any = item
    else:
        # The rollout runs inside its span: its completions (our clients send the trace
        # context) hang under it.
        with tracing.span("art.rollout", {"openinference.span.kind": "AGENT"}) as current:
            try:
                result = await item
            except Exception as e:  # a failed rollout; cancellation and interrupts propagate
                tracing.record_failure(current, e)
                if reporter is not None:
                    reporter.record_exception(e)
                return e
            if not isinstance(result, result_type):
                error = TrajectoryError(
                    f"a rollout returned {type(result).__name__}, expected a {result_type.__name__}"
                )
                tracing.record_failure(current, error)
                if reporter is not None:
                    reporter.record_exception(error)
                return error
            if current is not None:
                tracing.set_attributes(current, tracing.rollout_attributes(result))
                tracing.send_scores(current, result)
    if reporter is not None:
        reporter.record_trajectory(result)
    return result


async def cancel_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until each has ended (whatever it raised)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def wait_all(tasks: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """Results in order; on the first task that raises (or our own cancellation) cancel the rest."""
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        await cancel_all(tasks)
        raise
    if pending:
        await cancel_all(pending)
        errors = [t.exception() for t in done if not t.cancelled()]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
    return [t.result() for t in tasks]


async def run_rollouts(
    items: list[Any], reporter: RolloutReporter | None, result_type: type[T]
) -> list[T | BaseException]:
    """Await every rollout (or take every finished `result_type`, an `art.Trajectory`)
    concurrently; failed ones, and ones that returned anything else, come back as exception
    objects."""
    return await wait_all([asyncio.ensure_future(_run_one(item, reporter, result_type)) for item in items])
