"""The pipeline's one signal that something changed: workers, the trainer and evaluations wait on it."""

from __future__ import annotations

import asyncio


class Broadcast:
    """`wait()` returns at the next `notify()` (a single event loop: no lock)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()
