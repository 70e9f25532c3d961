"""Run an ASGI app with uvicorn on a background thread of this process.

A local backend serves its model in the same process as the user's training loop (the
engine shares weights with the trainer), yet rollouts must reach it over a real socket with
the official `openai` client. So uvicorn runs on a daemon thread with its own event loop.
We bind the socket ourselves before starting uvicorn: with port=0 the real port is known at
once, and a bind failure is raised in the caller's thread instead of dying inside uvicorn.
A server still running when the interpreter exits (a script that raised) is stopped by an
atexit hook, after the engines, so nothing is left serving while the interpreter finalizes.
"""

from __future__ import annotations

import atexit
import socket
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from art.errors import BackendError

if TYPE_CHECKING:
    import uvicorn


KEEP_ALIVE_S = 75
"""Idle keep-alive connections stay open this long. uvicorn's default (5 s) equals httpx's
client-side expiry, so a request sent on a connection as the server closes it (after a
training step longer than 5 s) failed with a ReadError; the client now always lets go first."""


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind(host: str, port: int) -> tuple[socket.socket, int]:
    """A socket bound (not yet listening) before anything starts, so port 0 gives the real port,
    and a bind failure is an OSError in the caller's thread."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock, sock.getsockname()[1]


_RUNNING: weakref.WeakSet[ServerThread] = weakref.WeakSet()
"""Servers started and not stopped yet: `_stop_at_exit` stops them."""


class ServerThread:
    """`with ServerThread(app) as server: client = OpenAI(base_url=server.base_url + "/v1")`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, start_timeout: float = 30.0) -> None:
        self.app = app
        self.host = host
        self.port = port
        """The bound port once started (the real one when 0 was asked)."""
        self.start_timeout = start_timeout
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return url_for(self.host, self.port)

    def start(self) -> ServerThread:
        """Block until the server accepts connections; raise BackendError if it cannot."""
        if self._thread is not None:
            raise BackendError("server already started")
        import uvicorn  # here, not at import: `bind` and `url_for` serve clients too (`art.backends.child`)

        try:
            sock, self.port = bind(self.host, self.port)
        except OSError as exc:
            raise BackendError(f"cannot bind {self.host}:{self.port}: {exc}") from exc
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            timeout_graceful_shutdown=5,
            lifespan="auto",
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._run, args=(server, sock), name=f"art-server-{self.port}", daemon=True
        )
        self._thread.start()
        _RUNNING.add(self)
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise BackendError(f"the HTTP server did not start: {self._error or 'timed out'}")
            time.sleep(0.01)
        return self

    def _run(self, server: uvicorn.Server, sock: socket.socket) -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # uvicorn exits via SystemExit on startup failure
            self._error = exc
        finally:
            sock.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to finish open requests and exit; wait for the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None
        self._server = None
        _RUNNING.discard(self)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


@atexit.register
def _stop_at_exit() -> None:
    """Servers left running by a script that ended (or raised) without closing its backend.
    The engines stop first (`art.engine.llm_engine`, when loaded): open requests then end at
    once with an error, so the graceful shutdown does not wait for them."""
    if "art.engine.llm_engine" in sys.modules:
        from art.engine.llm_engine import stop_all_engines

        stop_all_engines()
    for server in list(_RUNNING):
        server.stop()
