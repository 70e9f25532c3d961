"""`@limit_concurrency(n)`: at most `n` calls of an async function run at once (e.g. judge calls)."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

from art.numeric import is_int

from ..errors import ArtValueError

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def limit_concurrency(n: int, derive_key: Callable[..., Hashable] | None = None) -> Callable[[F], F]:
    """Allow `n` concurrent calls; with `derive_key(*args, **kwargs)`, `n` per key.

    Semaphores are kept per event loop, because an asyncio semaphore cannot be shared across
    loops (each `asyncio.run`, or each test, has its own).
    """
    if not is_int(n) or n < 1:
        raise ArtValueError(f"limit_concurrency(n) needs an int n >= 1, got {n!r}", field="n")

    def decorate(func: F) -> F:
        per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, asyncio.Semaphore]]
        per_loop = weakref.WeakKeyDictionary()

        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = derive_key(*args, **kwargs) if derive_key is not None else None
            semaphores = per_loop.setdefault(asyncio.get_running_loop(), {})
            if key not in semaphores:
                semaphores[key] = asyncio.Semaphore(n)
            async with semaphores[key]:
                return await func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
