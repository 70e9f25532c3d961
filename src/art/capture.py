"""Automatic trajectory capture: record an agent's model calls without rewriting the agent.

    with art.Trajectory() as trajectory:      # or: trajectory = await art.trajectory(run_agent(s))
        await run_agent(scenario)
    trajectory.reward = score(...)            # or, inside the agent: art.current_trajectory(require=True).reward = ...
    with art.TrajectoryGroup() as group:      # or: group = await art.trajectory_group(art.trajectory(...) ...)
        for _ in range(4):
            with art.Trajectory():
                await run_agent(scenario)

While a trajectory scope is open in the current context (`contextvars`: it follows the task and
the tasks it starts), every call to one of four APIs is recorded: Chat Completions, Completions,
Responses and Anthropic Messages (`art.exchanges`), whoever sends it, through `httpx` or
`httpx2` (the `openai` and `anthropic` SDKs, LangChain, the Agents SDK), `requests` or
`aiohttp`. Each call lands in `trajectory.exchanges` as sent and received (a stream rebuilt into
the whole answer), and the turn it stands for (`art.exchange_turns`: the request's messages and
the answer as a chat `Choice` with its token ids and logprobs) joins the conversation it
extends: the history (the trajectory or one of its `additional_histories`) whose messages and
tools begin the request's, the longest one when several do; a call that extends none starts a
new additional history. That is what trains. A failed call, a stream closed before its end and
the other choices of an `n > 1` call are left out, and `trajectory.logs` says so.

The hooks wrap the send methods of each HTTP library, installed when the first scope opens
(never at import) and inert outside one; they read answers and change nothing the caller sees.
This module knows nothing of models, backends, training or torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, Literal, overload

from .capture_hooks import install_hooks
from .capture_recorder import close_recorder, open_recorder
from .errors import CaptureError
from .message_items import message_key, message_text
from .trajectories import ExceptionRecord, MetadataValue, MetricValue, Trajectory, TrajectoryGroup
from .trajectory_scopes import SCOPE_HOOKS, current_group_scope, current_scope, hidden_scopes

__all__ = [
    "AutoTrajectoryContext",
    "auto_trajectory",
    "capture_auto_trajectory",
    "current_trajectory",
    "current_trajectory_group",
    "message_key",
    "message_text",
    "no_capture",
    "trajectory",
    "trajectory_group",
]

log = logging.getLogger(__name__)


class AutoTrajectoryContext:
    """`with AutoTrajectoryContext() as trajectory:` ART's older spelling of `with art.Trajectory()`."""

    def __init__(self) -> None:
        self.trajectory = Trajectory()

    def __enter__(self) -> Trajectory:
        return self.trajectory.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self.trajectory.__exit__(*exc_info)


def _current(require: bool, how: str) -> Trajectory | None:
    found = current_scope()
    if found is None and require:
        raise CaptureError(
            f"No trajectory is active in this context: call {how} inside `with art.Trajectory():`, "
            "`art.trajectory(...)` or `art.capture_auto_trajectory(...)` (and not under "
            "`art.no_capture()`)"
        )
    return found


@overload
def current_trajectory(*, require: Literal[True], required: bool | None = None) -> Trajectory: ...
@overload
def current_trajectory(*, require: bool = False, required: Literal[True]) -> Trajectory: ...
@overload
def current_trajectory(*, require: bool = False, required: bool | None = None) -> Trajectory | None: ...
def current_trajectory(*, require: bool = False, required: bool | None = None) -> Trajectory | None:
    """The trajectory being captured here (ART's name), or None outside a capture; `require=True`
    raises CaptureError (a RuntimeError) there instead. `required=` is ART's earlier spelling."""
    return _current(bool(require or required), "art.current_trajectory(require=True)")


def current_trajectory_group(*, require: bool = False) -> TrajectoryGroup | None:
    """The group of the innermost `with art.TrajectoryGroup():` here, or None (`require=True`: CaptureError)."""
    found = current_group_scope()
    if found is None and require:
        raise CaptureError(
            "No trajectory group is active in this context: call art.current_trajectory_group() "
            "inside `with art.TrajectoryGroup():`"
        )
    return found


@overload
def auto_trajectory(*, required: Literal[True]) -> Trajectory: ...
@overload
def auto_trajectory(*, required: bool = False) -> Trajectory | None: ...
def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """ART's older name of `current_trajectory`."""
    return _current(required, "auto_trajectory(required=True)")


@contextlib.contextmanager
def no_capture() -> Iterator[None]:
    """Hide the enclosing capture inside the block: calls made there are not recorded and
    `current_trajectory()` is None; a new `art.trajectory(...)` inside still captures."""
    with hidden_scopes():
        yield


def _check_coroutine(value: Any, name: str) -> None:
    # A Task or Future started already, in the context of whoever created it: a capture opened
    # now would never see its calls. ART refuses them the same way.
    if isinstance(value, asyncio.Future) or not isinstance(value, Coroutine):
        raise TypeError(
            f"{name}() takes a raw coroutine, the agent's coroutine itself, as in {name}(agent(...)); "
            f"got {type(value).__name__}. A Task or Future runs in the context it was created "
            "in, so a capture opened now would record none of its calls."
        )


async def trajectory(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    """Run `coroutine` (an agent) and return the trajectory of the calls it made (ART's name).
    Its return value is dropped; an exception it raises propagates."""
    _check_coroutine(coroutine, "trajectory")
    return await _captured(coroutine)


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    """ART's older name of `trajectory`."""
    _check_coroutine(coroutine, "capture_auto_trajectory")
    return await _captured(coroutine)


async def _captured(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    with Trajectory() as captured:
        await coroutine
    return captured


async def trajectory_group(
    trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]],
    *,
    exceptions: Iterable[BaseException | ExceptionRecord | Mapping[str, str]] = (),
    metadata: Mapping[str, MetadataValue] | None = None,
    metrics: Mapping[str, MetricValue] | None = None,
    logs: Iterable[str] | None = None,
    return_exceptions: bool = False,
) -> TrajectoryGroup:
    """A finished group from rollouts (typically `art.trajectory(agent(...))` coroutines),
    finished trajectories and exceptions, in the order given (ART's name).

    The awaitables run concurrently, outside any enclosing capture (`no_capture`); one given
    twice runs once. A rollout that raises fails the group, its siblings cancelled, unless
    `return_exceptions=True`, which keeps the exception in `group.exceptions` instead.
    Interrupts and cancellation always propagate.
    """
    given = list(exceptions)
    for error in given:
        _raise_interrupt(error)
    results: list[Trajectory | BaseException | None] = []
    slots: dict[asyncio.Future[Any], list[int]] = {}
    started: dict[int, asyncio.Future[Any]] = {}
    with hidden_scopes():
        try:
            for item in trajectories:
                if isinstance(item, (Trajectory, BaseException)):
                    _raise_interrupt(item)
                    results.append(item)
                    continue
                if not inspect.isawaitable(item):
                    raise TypeError(
                        f"trajectory_group() takes trajectories, exceptions and awaitables of "
                        f"trajectories; item {len(results)} is a {type(item).__name__}"
                    )
                task = started.get(id(item))
                if task is None:
                    task = started[id(item)] = asyncio.ensure_future(item)
                    slots[task] = []
                slots[task].append(len(results))
                results.append(None)
            pending = set(slots)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    outcome = _outcome(task, return_exceptions)
                    for index in slots[task]:
                        results[index] = outcome
        except BaseException:
            unfinished = [task for task in slots if not task.done()]
            for task in unfinished:
                task.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
            raise
    return TrajectoryGroup(
        [r for r in results if r is not None], exceptions=given, metadata=metadata, metrics=metrics, logs=logs or ()
    )


def _raise_interrupt(item: Any) -> None:
    if isinstance(item, BaseException) and not isinstance(item, Exception):
        raise item


def _outcome(task: asyncio.Future[Any], return_exceptions: bool) -> Trajectory | BaseException:
    try:
        result = task.result()
    except Exception as error:  # a failed rollout; cancellation and interrupts propagate
        if not return_exceptions:
            raise
        return error
    if not isinstance(result, Trajectory):
        raise TypeError(f"trajectory_group(): an awaitable gave a {type(result).__name__}, not a Trajectory")
    return result


# -- scopes ------------------------------------------------------------------------------


class _ScopeHook:
    """What `art.trajectory_scopes` calls when a trajectory scope opens and closes."""

    def entered(self, trajectory: Trajectory) -> None:
        install_hooks()
        open_recorder(trajectory)

    def exited(self, trajectory: Trajectory) -> None:
        close_recorder(trajectory)


SCOPE_HOOKS.append(_ScopeHook())
