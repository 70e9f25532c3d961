"""`LocalBackend(in_process=False)`: the model service in a child process, spoken to over HTTP.

The child is `art serve`'s app (`art.serve.create_serve_app` over a `LocalService` of the
backend's storage root) on a loopback socket with a random key, so the parent is a plain
`RemoteService` client and the runs on disk are laid out exactly as in process. A crash or a
CUDA fault in the backend then costs the user's process an exception, not its life.

Lifetime, both ways:
- The parent binds the listening socket and hands its descriptor to the child, so the port is
  known before the child starts, and a restarted child asks for the same port again (a
  re-registered model keeps its URL). The child's stdin is a pipe the parent never writes after
  the first line (the key and settings, kept out of argv and the environment); end of file on it
  means the parent is gone.
- No orphans, even after `kill -9` of the parent: on Linux the child asks the kernel for SIGKILL
  when its parent dies (`prctl(PR_SET_PDEATHSIG)`), and everywhere a watchdog thread exits the
  child when its stdin closes or its parent pid changes. The kernel signal follows the *thread*
  that spawned the child, so the parent spawns from its event loop's thread, never a worker.
- Everything the child prints goes to `{root}/backend-child.log`: the library writes nothing to
  the user's stdout. A child that dies is a `BackendError` naming its exit and the log's last
  lines; registering a model again starts a new child, which loads the latest checkpoint.

`ChildProcess.start` runs the child as `python -c "from art.backends.child import main; main()"`
(`-m` would import this module twice: `import art` already did).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from art.backends.remote import RemoteService
from art.errors import BackendError, BackendUnavailableError
from art.server.thread import bind, url_for
from art.service import ModelSpec

LOG_NAME = "backend-child.log"
"""The child's stdout and stderr, under the backend's storage root (appended across restarts)."""
START_TIMEOUT_S = 120.0
"""How long the child may take to import the server and answer /health."""
STOP_TIMEOUT_S = 15.0
"""How long `close` waits for a graceful shutdown (open requests, engines) before SIGKILL."""
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class ChildProcess:
    """One started child: its process, URL, key and log. `start` returns once /health answers."""

    def __init__(
        self, process: subprocess.Popen, url: str, port: int, key: str, log_path: Path, log_offset: int
    ) -> None:
        self.process, self.url, self.port, self.key = process, url, port, key
        self.log_path, self._log_offset = log_path, log_offset

    @classmethod
    async def start(
        cls,
        root: Path,
        *,
        placement: str,
        host: str,
        port: int,
        or_any_port: bool = False,
        timeout: float = START_TIMEOUT_S,
    ) -> ChildProcess:
        key = secrets.token_urlsafe(32)
        root.mkdir(parents=True, exist_ok=True)
        log_path = root / LOG_NAME
        src = str(Path(__file__).resolve().parents[2])  # art's own folder: the child imports this art
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        sock = _bind(host, port, or_any=or_any_port)
        fd, port = sock.fileno(), sock.getsockname()[1]
        try:
            with open(log_path, "ab") as out:
                offset = out.tell()
                out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} parent {os.getpid()} starts a child\n".encode())
                out.flush()
                # Spawned here, on the event loop's thread (see the module docstring), in its own
                # session so the terminal's Ctrl-C reaches the user's process only.
                process = subprocess.Popen(
                    [sys.executable, "-c", "from art.backends.child import main; main()"],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=out,
                    pass_fds=(fd,),
                    env=env,
                    start_new_session=True,
                )
        finally:
            sock.close()  # the child holds it now: a dead child leaves nothing listening (no hung connects)
        settings = {"parent": os.getpid(), "fd": fd, "key": key, "root": str(root), "placement": placement}
        if process.stdin is None:  # Popen makes one for stdin=PIPE
            process.kill()
            raise BackendError("the backend's child process has no stdin pipe to read its settings from")
        try:
            process.stdin.write(json.dumps(settings).encode() + b"\n")
            process.stdin.flush()  # stdin stays open: its end of file tells the child we are gone
        except BrokenPipeError:
            pass  # it died already; said below with its log
        child = cls(process, url_for(host, port), port, key, log_path, offset)
        try:
            await child._wait_ready(timeout)
        except BaseException:  # not ready in time, dead, or the caller was cancelled: leave nothing behind
            child.kill()
            raise
        return child

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if not self.alive():
                    raise BackendError(
                        f"the backend's child process did not start ({self.describe_exit()}); {self.log_tail()}"
                    )
                try:
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise BackendError(
                        f"the backend's child process (pid {self.pid}) did not answer {self.url}/health "
                        f"within {timeout:g} s; {self.log_tail()}"
                    )
                await asyncio.sleep(0.05)

    async def died(self, wait: float = 2.0) -> bool:
        """Whether the child has exited, waiting up to `wait` s: a broken connection comes just
        before the exit status."""
        if self.alive() and wait > 0:
            try:
                await asyncio.to_thread(self.process.wait, wait)
            except subprocess.TimeoutExpired:
                pass
        return not self.alive()

    def describe_exit(self) -> str:
        code = self.process.returncode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def log_tail(self, lines: int = 20) -> str:
        """The last lines this child wrote to its log, for error messages."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self._log_offset, f.seek(0, os.SEEK_END) - 16384))  # a long run's log is long
                text = f.read().decode(errors="replace")
        except OSError as exc:
            return f"its log {self.log_path} cannot be read: {exc}"
        tail = "\n".join(text.rstrip().splitlines()[-lines:])
        return f"the last lines of its log {self.log_path}:\n{tail}"

    async def stop(self, grace: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (uvicorn finishes open requests and the app stops the engines), then SIGKILL."""
        if self.alive():
            self.process.terminate()
            try:
                await asyncio.to_thread(self.process.wait, grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL unless it exited, reap it, close its stdin."""
        if self.alive():
            self.process.kill()
        self.process.wait()  # at once after SIGKILL
        if self.process.stdin is None:
            return
        try:
            self.process.stdin.close()
        except OSError:
            pass


class ChildService(RemoteService):
    """`RemoteService` against a child process it starts and stops itself.

    Its requests go through `_ChildTransport`, which sends each one to the current child with
    that child's key, starting the first child on the first request (a register, or a fork
    before it). A child that died is a `BackendError` saying so, and only `register` starts a
    new one: a training loop learns of the crash rather than silently continuing elsewhere.
    """

    def __init__(
        self,
        root: Path,
        *,
        placement: str = "processes",
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout: float = START_TIMEOUT_S,
    ) -> None:
        self.root, self.placement, self.host, self.port = Path(root), placement, host, port
        self.start_timeout = start_timeout
        """Seconds the child may take to answer /health."""
        self.child: ChildProcess | None = None
        self._starting = asyncio.Lock()
        self._closed = False
        super().__init__(url_for(host, port), None, transport=_ChildTransport(self))

    def __repr__(self) -> str:  # never shows the key
        return f"ChildService({str(self.root)!r}, pid={self.pid})"

    @property
    def pid(self) -> int | None:
        """The running child's process id (None before it starts, or once it died)."""
        return self.child.pid if self.child is not None and self.child.alive() else None

    async def register(self, spec: ModelSpec) -> int:
        await self.ensure_started()
        return await super().register(spec)

    async def ensure_started(self, *, restart: bool = True) -> ChildProcess:
        """The running child: the first one started now, and, with `restart`, a new one in place
        of one that died (on the same port if it is free, so models registered before keep
        their URL; each registers again on its own)."""
        async with self._starting:
            if self._closed:
                raise BackendUnavailableError("this LocalBackend was closed; create a new one")
            previous = self.child
            if previous is not None and (previous.alive() or not restart):
                return previous
            if previous is not None:
                previous.kill()  # dead already: reap it and close its pipe
            again = previous is not None and not self.port
            self.child = await ChildProcess.start(
                self.root,
                placement=self.placement,
                host=self.host,
                port=previous.port if previous is not None and again else self.port,
                or_any_port=again,
                timeout=self.start_timeout,
            )
            self.base_url = self.child.url  # for RemoteService's messages
            print(
                f"[art] backend in child process {self.child.pid} at {self.child.url} (dashboard "
                f"{self.child.url}/dashboard, log {self.child.log_path})",
                file=sys.stderr,
                flush=True,
            )
            return self.child

    async def close(self) -> None:
        """Close the connections and stop the child (gracefully, then by force)."""
        self._closed = True
        await super().close()
        if self.child is not None:
            await self.child.stop()


class _ChildTransport(httpx.AsyncBaseTransport):
    """Loopback HTTP to the service's current child, and a clear `BackendError` instead of a
    connection error when that child has died (before a request, or cutting its response)."""

    def __init__(self, service: ChildService) -> None:
        self.service = service
        self._http = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        child = await self.service.ensure_started(restart=False)
        if not child.alive():
            await self.raise_if_died(child, request, None)
        request.url = request.url.copy_with(host=self.service.host, port=child.port)
        request.headers["Authorization"] = f"Bearer {child.key}"
        try:
            response = await self._http.handle_async_request(request)
        except httpx.TransportError as exc:
            await self.raise_if_died(child, request, exc)
            raise
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            extensions=response.extensions,
            stream=_WatchedStream(response.stream, self, child, request),
        )

    async def raise_if_died(self, child: ChildProcess, request: httpx.Request, exc: Exception | None) -> None:
        if await child.died():
            raise BackendError(
                f"the backend's child process (pid {child.pid}) died ({child.describe_exit()}); "
                f"{request.method} {request.url.path} failed. Register the model again to start a new one (it "
                f"resumes from the latest checkpoint). {child.log_tail()}"
            ) from exc

    async def aclose(self) -> None:
        await self._http.aclose()


class _WatchedStream(httpx.AsyncByteStream):
    def __init__(self, stream, transport: _ChildTransport, child: ChildProcess, request: httpx.Request) -> None:
        self._stream, self._transport, self._child, self._request = stream, transport, child, request

    async def __aiter__(self):
        try:
            async for chunk in self._stream:
                yield chunk
        except httpx.TransportError as exc:
            await self._transport.raise_if_died(self._child, self._request, exc)
            raise

    async def aclose(self) -> None:
        await self._stream.aclose()


def _bind(host: str, port: int, *, or_any: bool = False) -> socket.socket:
    """A socket bound (not yet listening: the child listens) to `port`; with `or_any`, a free
    port when that one is taken (a restart asks for its predecessor's)."""
    try:
        return bind(host, port)[0]
    except OSError as exc:
        if or_any:
            return _bind(host, 0)
        raise BackendError(f"cannot bind {host}:{port} for the backend's child process: {exc}") from exc


# -- the child's side -----------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """Exit when the parent does, however it ends (see the module docstring)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            print(
                f"prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}); the watchdog thread remains",
                file=sys.stderr,
                flush=True,
            )
    if os.getppid() != parent:  # it died before the kernel was told
        os._exit(1)

    def watch() -> None:
        stdin = sys.stdin.buffer.fileno()
        while True:
            readable, _, _ = select.select([stdin], [], [], 1.0)
            if (readable and not os.read(stdin, 4096)) or os.getppid() != parent:
                print(f"the parent process {parent} is gone: exiting", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="art-parent-watchdog", daemon=True).start()


def main() -> None:
    settings = json.loads(sys.stdin.buffer.readline() or b"{}")
    if not settings:
        sys.exit("art.backends.child.main is started by LocalBackend(in_process=False), not by hand")
    _die_with_parent(settings["parent"])
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("art").setLevel(logging.INFO)
    print(f"child {os.getpid()} of {settings['parent']}: serving {settings['root']}", file=sys.stderr, flush=True)

    import uvicorn

    from art.serve import create_serve_app
    from art.server.thread import KEEP_ALIVE_S
    from art.service.local import LocalService

    service = LocalService(settings["root"], placement=settings["placement"])
    # model_roots=None: any base_model path, as in process (the user's own machine and key).
    app = create_serve_app(service, api_key=settings["key"], model_roots=None)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S)
    )
    server.run(sockets=[socket.socket(fileno=settings["fd"])])  # SIGTERM: graceful, then the app closes
