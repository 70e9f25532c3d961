"""`@retry(...)`: call a flaky function (a judge, a tool, an API) again after failures.

One decorator for sync and async functions, so rollout code can wrap either; the async
variant sleeps with `asyncio.sleep` and never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

from art.numeric import is_finite, is_int

from .errors import ArtValueError

F = TypeVar("F", bound=Callable[..., Any])


def _check(max_attempts: Any, delay: Any, backoff_factor: Any, exceptions: Any, on_retry: Any) -> None:
    problems: list[tuple[str, str]] = []
    if not is_int(max_attempts) or max_attempts < 1:
        problems.append(("max_attempts", f"max_attempts must be an int >= 1, got {max_attempts!r}"))
    if not is_finite(delay) or delay < 0:
        problems.append(("delay", f"delay must be a finite number of seconds >= 0, got {delay!r}"))
    if not is_finite(backoff_factor) or backoff_factor <= 0:
        problems.append(("backoff_factor", f"backoff_factor must be a finite number > 0, got {backoff_factor!r}"))
    if (
        not isinstance(exceptions, tuple)
        or not exceptions
        or not all(isinstance(e, type) and issubclass(e, BaseException) for e in exceptions)
    ):
        problems.append(
            ("exceptions", f"exceptions must be a non-empty tuple of exception classes, got {exceptions!r}")
        )
    if on_retry is not None and not callable(on_retry):
        problems.append(("on_retry", f"on_retry must be callable or None, got {on_retry!r}"))
    if problems:
        raise ArtValueError("invalid retry(): " + "; ".join(p for _, p in problems), field=problems[0][0])


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> Callable[[F], F]:
    """Retry the decorated function up to `max_attempts` times in all.

    Only `exceptions` are retried; others propagate at once. The wait starts at `delay`
    seconds and is multiplied by `backoff_factor` after each failure. `on_retry(exc, attempt)`
    is called before each wait, with the 1-based number of the attempt that failed. The last
    failure is re-raised unchanged.
    """
    if callable(max_attempts) and not isinstance(max_attempts, int):  # bare `@retry`
        return retry()(max_attempts)
    if isinstance(exceptions, type):
        exceptions = (exceptions,)
    _check(max_attempts, delay, backoff_factor, exceptions, on_retry)

    def decorate(func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                wait = delay
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await func(*args, **kwargs)
                    except exceptions as e:
                        if attempt == max_attempts:
                            raise
                        if on_retry is not None:
                            on_retry(e, attempt)
                        await asyncio.sleep(wait)
                        wait *= backoff_factor

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            wait = delay
            for attempt in range(1, max_attempts + 1):
                try:
                    return func(*args, **kwargs)
                except exceptions as e:
                    if attempt == max_attempts:
                        raise
                    if on_retry is not None:
                        on_retry(e, attempt)
                    time.sleep(wait)
                    wait *= backoff_factor

        return wrapper  # type: ignore[return-value]

    return decorate
