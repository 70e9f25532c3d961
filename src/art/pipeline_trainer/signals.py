"""SIGINT/SIGTERM for a running pipeline: the first asks it to stop after the step being trained
(which is then saved), the second cancels it at once."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from tqdm.auto import tqdm


def install_stop_signals(
    main: asyncio.Task | None, stopping: Callable[[], bool], stop: Callable[[], None]
) -> Callable[[], None]:
    """Handle both signals on the running loop; the answer puts the previous handlers back. Off the
    main thread (or on Windows) no handler can be installed and the signals keep their default."""
    loop, installed = asyncio.get_running_loop(), []

    def on_signal(sig: signal.Signals) -> None:
        if stopping() and main is not None:  # the second one: now
            main.cancel()
            return
        tqdm.write(f"[art] {sig.name}: stopping after the current step (again to stop now)")
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
            pass

    def restore() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return restore
