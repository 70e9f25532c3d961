"""Run many rollouts at once: a progress bar, a limit on failed rollouts, per-group hooks.

Groups awaited under `gather_trajectory_groups` find its `GatherProgress` through a context
variable, so every trajectory is counted the moment it finishes and the whole gather stops
(cancelling what still runs) as soon as one exception too many has been seen.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from art.numeric import is_int

from .errors import ArtValueError, TooManyExceptionsError, TrajectoryError
from .gather_progress import (
    GatherProgress,
)
from .observability import tracing
from .rollout_runs import ROLLOUT_REPORTER, cancel_all, run_rollouts, wait_all
from .training.advantages import rewards_differ
from .trajectories import Trajectory, TrajectoryGroup


def _check_awaitables(items: list[Any], what: str) -> None:
    bad = [i for i, item in enumerate(items) if not inspect.isawaitable(item)]
    if bad:
        first = type(items[bad[0]]).__name__
        raise ArtValueError(f"{what} must be awaitables; items {bad} are not (the first is a {first})")


async def _finish_group(
    item: Awaitable[TrajectoryGroup],
    progress: GatherProgress,
    after_each: Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]] | None,
) -> TrajectoryGroup | None:
    if isinstance(item, TrajectoryGroup):
        group: Any = await item  # its rollouts' exceptions are counted inside it
    else:
        try:
            group = await item
        except TooManyExceptionsError:
            raise
        except Exception as e:  # a whole group failed to build: one exception, no trajectories
            progress.expect(e, 1)
            progress.record_exception(e)
            return None
        if not isinstance(group, TrajectoryGroup):
            raise TrajectoryError(f"expected an awaitable of TrajectoryGroup, it gave {type(group).__name__}")
    progress.account(group)
    if not group.trajectories:
        return None
    if after_each is not None:
        answer = after_each(group)
        judged = await answer if inspect.isawaitable(answer) else answer  # a plain function works too
        if isinstance(judged, TrajectoryGroup):
            progress.rescore(group, judged)
        group = judged
    return group if group is not None and len(group.trajectories) else None


@dataclass
class GatherStats:
    """What one gather spent: every rollout it ran, kept or not."""

    groups_drawn: int = 0
    """Groups started (drawn from the input)."""
    groups_kept: int = 0
    groups_without_signal: int = 0
    """Dropped by dynamic sampling: every reward equal, so they would train nothing."""
    rollouts: int = 0
    """Finished rollouts, failed ones included, in kept and dropped groups alike."""
    reward_mean: float | None = None
    """Mean reward of every finished rollout, dropped groups included: the policy's reward
    (the kept groups alone over-represent mixed outcomes). Where `after_each` rescored a group
    (RULER), its rewards are the new ones, as the progress bar shows."""


class GatheredGroups(list):
    """The list of groups `gather_trajectory_groups` returns, with its `stats`; `model.train`
    reads them to report the rollouts spent per trained group."""

    def __init__(self, groups: Iterable[TrajectoryGroup] = (), stats: GatherStats | None = None) -> None:
        super().__init__(groups)
        self.stats = stats or GatherStats()


def has_signal(group: TrajectoryGroup) -> bool:
    """Whether the group's rewards differ, by the trainer's own test (it skips the others)."""
    return rewards_differ([float(t.reward) for t in group.trajectories])


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    pbar_total_completion_tokens: bool = True,
    max_exceptions: int | float = 0,
    max_metrics: int | None = None,
    after_each: Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]] | None = None,
    min_groups_with_signal: int | None = None,
    max_groups: int | None = None,
) -> GatheredGroups:
    """Run every group concurrently and return the finished ones in input order.

    `max_exceptions` is a count, or a fraction of all trajectories when a float in (0, 1);
    one failed rollout more raises TooManyExceptionsError. Failed rollouts within the limit
    are dropped from their group (kept in `group.exceptions`), empty groups are dropped, and
    `after_each(group)` may return a replacement (e.g. RULER-scored) or None to drop it.
    `pbar_desc=None` hides the progress bar; `max_metrics` caps how many trajectory metrics
    it shows; `pbar_total_completion_tokens=False` leaves out the completion-token count.

    Dynamic sampling (DAPO, Yu et al. 2025) with `min_groups_with_signal=N`: groups whose
    rewards are all equal (after `after_each`) are dropped, since GRPO trains nothing on them,
    and further groups are drawn from `groups` until N groups with signal are gathered or
    `max_groups` (default 4N) have been drawn. `groups` is then read lazily, N at a time in
    flight, so it may be an endless generator; a group is only started when one is still
    needed, so no rollout runs past the target. The returned list's `stats` (`GatherStats`)
    count what was drawn, kept and dropped.
    """
    if min_groups_with_signal is None and max_groups is not None:
        raise ArtValueError("max_groups bounds dynamic sampling: set min_groups_with_signal too", field="max_groups")
    if min_groups_with_signal is not None:
        target, cap = _check_dynamic_sampling(min_groups_with_signal, max_groups)
    progress = GatherProgress(pbar_desc, max_exceptions, max_metrics, pbar_total_completion_tokens)
    if min_groups_with_signal is not None:
        with tracing.span(
            "art.gather", {"openinference.span.kind": "CHAIN", "art.min_groups_with_signal": target}
        ) as current:
            try:
                gathered = await _gather_with_signal(
                    iter(groups), progress, after_each, target, cap, finite=isinstance(groups, (list, tuple))
                )
            finally:
                progress.close()
            tracing.set_attributes(
                current, {"art.groups": gathered.stats.groups_drawn, "art.groups_kept": len(gathered)}
            )
        return gathered
    items = list(groups)
    _check_awaitables(items, "groups")
    for item in items:
        if isinstance(item, TrajectoryGroup):
            progress.expect(item, len(item))
    with tracing.span("art.gather", {"openinference.span.kind": "CHAIN", "art.groups": len(items)}) as current:
        token = ROLLOUT_REPORTER.set(progress)  # tasks copy the context (and the span) when created
        try:
            tasks = [asyncio.ensure_future(_finish_group(item, progress, after_each)) for item in items]
        finally:
            ROLLOUT_REPORTER.reset(token)
        try:
            results = await wait_all(tasks)
        finally:
            progress.close()
        kept = [group for group in results if group is not None]
        tracing.set_attributes(current, {"art.groups_kept": len(kept)})
    return GatheredGroups(
        kept,
        GatherStats(
            groups_drawn=len(items),
            groups_kept=len(kept),
            rollouts=progress.finished + progress.exceptions,
            reward_mean=progress.reward_mean(),
        ),
    )


def _check_dynamic_sampling(target, cap) -> tuple[int, int]:
    if not (is_int(target) and target >= 1):
        raise ArtValueError(
            f"min_groups_with_signal must be a positive int or None, got {target!r}", field="min_groups_with_signal"
        )
    cap = 4 * target if cap is None else cap
    if not (is_int(cap) and cap >= target):
        raise ArtValueError(
            f"max_groups must be an int >= min_groups_with_signal ({target}), got {cap!r}", field="max_groups"
        )
    return target, cap


async def _gather_with_signal(
    items: Iterator[Any], progress: GatherProgress, after_each, target: int, cap: int, finite: bool
) -> GatheredGroups:
    """Keep `target - kept` groups in flight, drawing the next one each time a group ends
    without signal, until `target` are kept or `cap` drawn; results in draw order. `finite`:
    the input is a list, whose undrawn coroutines are closed at the end (a generator's are
    never made)."""
    stats = GatherStats()
    kept: dict[int, TrajectoryGroup] = {}
    in_flight: dict[asyncio.Future, int] = {}

    def draw() -> bool:
        item = next(items, None)
        if item is None:
            return False
        _check_awaitables([item], "groups")
        if isinstance(item, TrajectoryGroup):
            progress.expect(item, len(item))
        token = ROLLOUT_REPORTER.set(progress)  # the task copies the context when created
        try:
            in_flight[asyncio.ensure_future(_finish_group(item, progress, after_each))] = stats.groups_drawn
        finally:
            ROLLOUT_REPORTER.reset(token)
        stats.groups_drawn += 1
        return True

    def refill() -> None:
        while len(kept) + len(in_flight) < target and stats.groups_drawn < cap and draw():
            pass

    try:
        refill()
        while in_flight:
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = in_flight.pop(task)
                group = task.result()  # TooManyExceptionsError and hook errors propagate
                if group is not None and has_signal(group):
                    kept[index] = group
                elif group is not None:
                    stats.groups_without_signal += 1
                    progress.note("groups_without_signal", stats.groups_without_signal)
            refill()
    except BaseException:
        await cancel_all(in_flight)
        raise
    finally:
        for item in items if finite else ():
            _discard(item)
    stats.groups_kept = len(kept)
    stats.rollouts = progress.finished + progress.exceptions
    stats.reward_mean = progress.reward_mean()
    return GatheredGroups([kept[i] for i in sorted(kept)], stats)


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
) -> list[Trajectory]:
    """`gather_trajectory_groups` for a flat list: finished trajectories in input order."""
    items = list(trajectories)
    _check_awaitables([i for i in items if not isinstance(i, Trajectory)], "trajectories")
    progress = GatherProgress(pbar_desc, max_exceptions, None, True)
    progress.expect(items, len(items))
    with tracing.span("art.gather", {"openinference.span.kind": "CHAIN", "art.rollouts": len(items)}):
        try:
            results = await run_rollouts(items, progress, Trajectory)
        finally:
            progress.close()
    return [r for r in results if isinstance(r, Trajectory)]


def _discard(item: Any) -> None:
    # Skipped work is never run; close coroutines so Python does not warn they were never awaited.
    if isinstance(item, TrajectoryGroup):
        item.discard()
    elif inspect.iscoroutine(item):
        item.close()


async def trajectory_group_batches(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str | None = "batches",
    pbar_total_completion_tokens: bool = True,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Yield lists of `batch_size` finished groups, in the order they finish (the last may be short).

    Groups are pulled from `groups` lazily, at most `batch_size * max_concurrent_batches` in
    flight, so the next batches sample while the caller trains on this one. The first
    `skip_batches * batch_size` groups are skipped unrun (resuming). A failed rollout, or a
    group that failed to build, counts against `max_batch_exceptions` (as `max_exceptions` of
    `gather_trajectory_groups`, but for each batch anew) and is left out; one more raises
    TooManyExceptionsError. Empty groups are dropped. Each batch has its own progress bar
    (`pbar_desc=None` hides it).
    """
    problems = [
        f"{name} must be an int >= {low}, got {value!r}"
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("max_concurrent_batches", max_concurrent_batches, 1),
            ("skip_batches", skip_batches, 0),
        )
        if not is_int(value) or value < low
    ]
    if problems:
        raise ArtValueError("; ".join(problems), field=problems[0].split(" ", 1)[0])
    source = iter(groups)
    for _ in range(skip_batches * batch_size):
        skipped = next(source, None)  # a group is never None
        if skipped is None:
            return
        _discard(skipped)

    in_flight: dict[asyncio.Future, Any] = {}
    progress = GatherProgress(
        pbar_desc, max_batch_exceptions, None, pbar_total_completion_tokens, "max_batch_exceptions"
    )
    batch: list[TrajectoryGroup] = []
    exhausted = False
    try:
        while True:
            while not exhausted and len(in_flight) < batch_size * max_concurrent_batches:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    continue
                _check_awaitables([item], "groups")
                if isinstance(item, TrajectoryGroup):
                    progress.expect(item, len(item))
                token = ROLLOUT_REPORTER.set(progress)  # its rollouts report to the batch being filled
                try:
                    in_flight[asyncio.ensure_future(_finish_group(item, progress, None))] = item
                finally:
                    ROLLOUT_REPORTER.reset(token)
            if not in_flight:
                break
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del in_flight[task]
                group = task.result()  # TooManyExceptionsError propagates
                if group is not None:
                    batch.append(group)
                if len(batch) == batch_size:
                    progress.close()
                    yield batch
                    batch = []
                    # Every batch has its own budget; the groups in flight finish into the next ones.
                    progress.reset(sum(len(i) if isinstance(i, TrajectoryGroup) else 1 for i in in_flight.values()))
        if batch:
            yield batch
    finally:
        progress.close()
        await cancel_all(list(in_flight))
