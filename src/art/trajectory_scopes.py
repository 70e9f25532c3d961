"""Which trajectory and which group are open here: the scopes `with art.Trajectory()` and
`with art.TrajectoryGroup()` open.

Kept apart from `art.trajectories` so that the data types stay data: this module holds the
context variables (`contextvars`: a scope follows the task and the tasks it starts), the order
check, the hooks told when a trajectory scope opens and closes, and `hidden_scopes`. It sits
below `art.trajectories` and never imports it, so it treats trajectories and groups as opaque
values (typed `Any`); what a trajectory does when its scope closes (finish, join its group)
stays in `Trajectory.__exit__`. `art.capture` records calls into the innermost trajectory scope:
it registers itself in `SCOPE_HOOKS`, so that this module, below it, never imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Protocol


class ScopeHook(Protocol):
    """What `art.capture` registers to be told when a trajectory scope opens and closes."""

    def entered(self, trajectory: Any) -> None: ...
    def exited(self, trajectory: Any) -> None: ...


SCOPE_HOOKS: list[ScopeHook] = []
"""Called in order as each trajectory scope opens and closes (`art.capture` adds its recorder)."""

_TRAJECTORY_SCOPES: ContextVar[tuple[Any, ...]] = ContextVar("art_trajectory_scopes", default=())
_GROUP_SCOPES: ContextVar[tuple[Any, ...]] = ContextVar("art_group_scopes", default=())


def enter_scope(trajectory: Any) -> None:
    """Open `trajectory`'s scope here (innermost) and tell the hooks."""
    _TRAJECTORY_SCOPES.set((*_TRAJECTORY_SCOPES.get(), trajectory))
    for hook in SCOPE_HOOKS:
        hook.entered(trajectory)


def exit_scope(trajectory: Any) -> None:
    """Close `trajectory`'s scope, which must be the innermost, and tell the hooks."""
    scopes = _TRAJECTORY_SCOPES.get()
    if not scopes or scopes[-1] is not trajectory:
        raise RuntimeError("Trajectory contexts must exit in the order they were entered")
    _TRAJECTORY_SCOPES.set(scopes[:-1])
    for hook in SCOPE_HOOKS:
        hook.exited(trajectory)


def enter_group_scope(group: Any) -> None:
    """Open `group`'s scope here (innermost): trajectories whose scopes close inside join it."""
    _GROUP_SCOPES.set((*_GROUP_SCOPES.get(), group))


def exit_group_scope(group: Any) -> None:
    """Close `group`'s scope, which must be the innermost group scope."""
    groups = _GROUP_SCOPES.get()
    if not groups or groups[-1] is not group:
        raise RuntimeError("TrajectoryGroup contexts must exit in the order they were entered")
    _GROUP_SCOPES.set(groups[:-1])


def current_scope() -> Any:
    """The trajectory (`art.Trajectory`) of the innermost open scope here, or None."""
    scopes = _TRAJECTORY_SCOPES.get()
    return scopes[-1] if scopes else None


def current_group_scope() -> Any:
    """The group (`art.TrajectoryGroup`) of the innermost open group scope here, or None."""
    groups = _GROUP_SCOPES.get()
    return groups[-1] if groups else None


@contextlib.contextmanager
def hidden_scopes() -> Iterator[None]:
    """Hide the enclosing scopes inside the block (new ones opened inside still count)."""
    trajectories, groups = _TRAJECTORY_SCOPES.set(()), _GROUP_SCOPES.set(())
    try:
        yield
    finally:
        _TRAJECTORY_SCOPES.reset(trajectories)
        _GROUP_SCOPES.reset(groups)
