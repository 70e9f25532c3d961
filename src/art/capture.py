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
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, Literal, overload
from urllib.parse import urlsplit

from .errors import CaptureError
from .exchange_turns import NotATurn, chat_turn
from .exchanges import Endpoint, IncompleteExchange, build_exchange, endpoint_of
from .trajectories import (
    SCOPE_HOOKS,
    ExceptionRecord,
    MetadataValue,
    MetricValue,
    Trajectory,
    TrajectoryGroup,
    add_turn,
    current_group_scope,
    current_scope,
    hidden_scopes,
    message_key,
    message_text,
)

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

_WHAT = {
    "chat_completions": "a chat completion",
    "completions": "a completion",
    "responses": "a response",
    "messages": "a message",
}


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


# -- recording ---------------------------------------------------------------------------


class _Recorder:
    """One open scope's recording. Calls may finish on other threads (sync clients), hence the lock."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.lock = threading.Lock()
        self.open: set[_Pending] = set()

    def note(self, message: str) -> None:
        with self.lock:
            self.trajectory.log(message)
        log.debug("capture: %s", message)

    def flush(self) -> None:
        for pending in list(self.open):
            pending.finish()

    def record(
        self,
        endpoint: Endpoint,
        request: dict[str, Any],
        content_type: str,
        body: bytes | Callable[[], bytes],
        started: datetime,
    ) -> None:
        """Add the call to `exchanges` and its turn to the history it extends. Never raises: the
        agent's call has succeeded whatever happens here."""
        what = _WHAT[endpoint]
        try:
            _, exchange = build_exchange(
                endpoint,
                request,
                body() if callable(body) else body,
                start_time=started,
                end_time=datetime.now(),
                content_type=content_type,
            )
        except IncompleteExchange as exc:
            self.note(f"{exc}; not recorded")
            return
        except Exception as exc:  # a capture problem must not fail the agent's call
            self.note(
                f"{what}'s answer could not be read ({type(exc).__name__}: {str(exc).splitlines()[0]}); not recorded"
            )
            return
        try:
            turn = chat_turn(exchange)
        except (NotATurn, ValueError) as exc:
            turn = None
            self.note(f"{what} is recorded in exchanges but trains nothing ({str(exc).splitlines()[0]})")
        with self.lock:
            self.trajectory.exchanges.add(exchange)
            if turn is not None:
                for note in turn.notes:
                    self.trajectory.log(note)
                add_turn(self.trajectory, turn)


_RECORDERS: dict[int, _Recorder] = {}
_RECORDERS_LOCK = threading.Lock()


class _ScopeHook:
    """What `art.trajectories` calls when a trajectory scope opens and closes."""

    def entered(self, trajectory: Trajectory) -> None:
        _install()
        with _RECORDERS_LOCK:
            _RECORDERS.setdefault(id(trajectory), _Recorder(trajectory))

    def exited(self, trajectory: Trajectory) -> None:
        with _RECORDERS_LOCK:
            recorder = _RECORDERS.pop(id(trajectory), None)
        if recorder is not None:
            recorder.flush()  # streams left open: what they carried in full still counts


SCOPE_HOOKS.append(_ScopeHook())


def _recorder_of(trajectory: Trajectory | None) -> _Recorder | None:
    if trajectory is None:
        return None
    with _RECORDERS_LOCK:
        return _RECORDERS.get(id(trajectory))


def _active() -> _Recorder | None:
    return _recorder_of(current_scope())


def _read_request(method: str, path: str, content: Any) -> tuple[Endpoint, dict[str, Any]] | None:
    """The API and JSON body of a call worth recording, else None."""
    if method.upper() != "POST" or content is None:
        return None
    try:
        body = json.loads(content) if not isinstance(content, Mapping) else dict(content)
    except Exception:  # a streamed upload (not read yet) or not JSON: not a call we can read
        return None
    if not isinstance(body, dict):
        return None
    endpoint = endpoint_of(path, body)
    return (endpoint, body) if endpoint is not None else None


class _Pending:
    """A streamed answer being read: its bytes are kept until it ends or closes."""

    def __init__(
        self,
        recorder: _Recorder,
        endpoint: Endpoint,
        request: dict,
        content_type: str,
        started: datetime,
        decode: Callable[[bytes], bytes] = lambda raw: raw,
    ) -> None:
        self.recorder, self.endpoint, self.request = recorder, endpoint, request
        self.content_type, self.started, self.decode = content_type, started, decode
        self.parts: list[bytes] = []
        self.done = False
        recorder.open.add(self)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.recorder.open.discard(self)
        self.recorder.record(
            self.endpoint, self.request, self.content_type, lambda: self.decode(b"".join(self.parts)), self.started
        )


def _failed(recorder: _Recorder, endpoint: Endpoint, status: int) -> bool:
    if 200 <= status < 300:
        return False
    recorder.note(f"{_WHAT[endpoint]} failed with HTTP {status}; not recorded")
    return True


# -- httpx (and httpx2) ------------------------------------------------------------------


def _httpx_decoder(lib: Any, headers: Mapping[str, str]) -> Callable[[bytes], bytes]:
    """The body as the caller reads it: raw stream bytes may still be compressed."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return lambda raw: raw
    return lambda raw: lib.Response(200, headers={"content-encoding": encoding}, content=raw).read()


def _delegate(tee: Any, name: str) -> Any:
    inner = tee.__dict__.get("inner")
    if inner is None or name.startswith("__"):
        raise AttributeError(name)
    return getattr(inner, name)


@functools.cache
def _tees(lib: Any) -> tuple[type, type]:
    """Byte streams (subclasses of `lib`'s, which httpx checks) that copy what passes through."""

    class SyncTee(lib.SyncByteStream):
        def __init__(self, inner: Any, pending: _Pending) -> None:
            self.inner, self.pending = inner, pending

        def __iter__(self):
            for part in self.inner:
                self.pending.parts.append(part)
                yield part
            self.pending.finish()

        def close(self) -> None:
            try:
                self.inner.close()
            finally:
                self.pending.finish()

        def __getattr__(self, name: str) -> Any:  # what httpx may read off its own stream (`elapsed`)
            return _delegate(self, name)

    class AsyncTee(lib.AsyncByteStream):
        def __init__(self, inner: Any, pending: _Pending) -> None:
            self.inner, self.pending = inner, pending

        async def __aiter__(self):
            async for part in self.inner:
                self.pending.parts.append(part)
                yield part
            self.pending.finish()

        async def aclose(self) -> None:
            try:
                await self.inner.aclose()
            finally:
                self.pending.finish()

        def __getattr__(self, name: str) -> Any:  # what httpx may read off its own stream (`elapsed`)
            return _delegate(self, name)

    return SyncTee, AsyncTee


def _httpx_observe(
    recorder: _Recorder, lib: Any, call: tuple[Endpoint, dict], response: Any, sync: bool, started: datetime
) -> None:
    endpoint, request = call
    if _failed(recorder, endpoint, response.status_code):
        return
    content_type = response.headers.get("content-type", "")
    try:
        content = response.content  # read already: a whole (not streamed) answer
    except lib.ResponseNotRead:
        sync_tee, async_tee = _tees(lib)
        pending = _Pending(recorder, endpoint, request, content_type, started, _httpx_decoder(lib, response.headers))
        response.stream = (sync_tee if sync else async_tee)(response.stream, pending)
        return
    recorder.record(endpoint, request, content_type, content, started)


def _httpx_call(request: Any) -> tuple[Endpoint, dict] | None:
    try:
        content = request.content
    except Exception:  # a streamed upload, not read yet: not a call we can read
        return None
    return _read_request(request.method, request.url.path, content)


def _httpx_hooked(lib: Any, original: Callable, sync: bool) -> Callable:
    if sync:

        @functools.wraps(original)
        def send(self, request, *args, **kwargs):
            recorder = _active()
            call = _httpx_call(request) if recorder is not None else None
            started = datetime.now()
            response = original(self, request, *args, **kwargs)
            if call is not None:
                _httpx_observe(recorder, lib, call, response, sync=True, started=started)
            return response
    else:

        @functools.wraps(original)
        async def send(self, request, *args, **kwargs):
            recorder = _active()
            call = _httpx_call(request) if recorder is not None else None
            started = datetime.now()
            response = await original(self, request, *args, **kwargs)
            if call is not None:
                _httpx_observe(recorder, lib, call, response, sync=False, started=started)
            return response

    send.__art_capture__ = True  # type: ignore[attr-defined]
    return send


def _install_httpx(lib: Any) -> None:
    for cls, sync in ((lib.Client, True), (lib.AsyncClient, False)):
        if not getattr(cls.send, "__art_capture__", False):
            cls.send = _httpx_hooked(lib, cls.send, sync)


# -- requests ----------------------------------------------------------------------------


class _RequestsTee:
    """Stands in for a streamed `requests` response's `raw` (urllib3), copying the decoded bytes
    that `iter_content` and `.content` read through `stream()` and `read()`."""

    def __init__(self, inner: Any, pending: _Pending) -> None:
        self.inner, self.pending = inner, pending

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        try:
            for part in self.inner.stream(*args, **kwargs):
                self.pending.parts.append(part)
                yield part
        finally:
            self.pending.finish()

    def read(self, *args: Any, **kwargs: Any) -> bytes:
        part = self.inner.read(*args, **kwargs)
        self.pending.parts.append(part)
        if not part or self.inner.closed:
            self.pending.finish()
        return part

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.pending.finish()

    def __getattr__(self, name: str) -> Any:
        return _delegate(self, name)


def _install_requests(lib: Any) -> None:
    original = lib.Session.send
    if getattr(original, "__art_capture__", False):
        return

    @functools.wraps(original)
    def send(self, request, **kwargs):
        recorder = _active()
        call = (
            _read_request(request.method or "", urlsplit(request.url).path, request.body)
            if recorder is not None
            else None
        )
        started = datetime.now()
        response = original(self, request, **kwargs)
        if call is not None and not _failed(recorder, call[0], response.status_code):
            content_type = response.headers.get("content-type", "")
            if kwargs.get("stream"):
                pending = _Pending(recorder, call[0], call[1], content_type, started)
                response.raw = _RequestsTee(response.raw, pending)
            else:
                recorder.record(call[0], call[1], content_type, response.content, started)
        return response

    send.__art_capture__ = True  # type: ignore[attr-defined]
    lib.Session.send = send


# -- aiohttp -----------------------------------------------------------------------------


class _AiohttpTee:
    """Stands in for an aiohttp response's `content` (a StreamReader), copying what is read."""

    def __init__(self, inner: Any, pending: _Pending) -> None:
        self.inner, self.pending = inner, pending

    def _seen(self, value: Any) -> Any:
        part = value[0] if isinstance(value, tuple) else value
        if isinstance(part, bytes):
            self.pending.parts.append(part)
        if self.inner.at_eof():
            self.pending.finish()
        return value

    async def read(self, *args: Any, **kwargs: Any) -> bytes:
        return self._seen(await self.inner.read(*args, **kwargs))

    async def readany(self) -> bytes:
        return self._seen(await self.inner.readany())

    async def readline(self) -> bytes:
        return self._seen(await self.inner.readline())

    async def readuntil(self, *args: Any) -> bytes:
        return self._seen(await self.inner.readuntil(*args))

    async def readexactly(self, n: int) -> bytes:
        return self._seen(await self.inner.readexactly(n))

    async def readchunk(self) -> tuple[bytes, bool]:
        return self._seen(await self.inner.readchunk())

    async def _iterate(self, parts: Any) -> Any:
        try:
            async for part in parts:
                yield self._seen(part)
        finally:
            self.pending.finish()

    def __aiter__(self) -> Any:
        return self._iterate(self.inner.__aiter__())

    def iter_any(self) -> Any:
        return self._iterate(self.inner.iter_any())

    def iter_chunked(self, size: int) -> Any:
        return self._iterate(self.inner.iter_chunked(size))

    def iter_chunks(self) -> Any:
        return self._iterate(self.inner.iter_chunks())

    def __getattr__(self, name: str) -> Any:
        return _delegate(self, name)


def _install_aiohttp(lib: Any) -> None:
    # aiohttp has no public send hook: every request method of a session goes through `_request`.
    original = lib.ClientSession._request
    if getattr(original, "__art_capture__", False):
        return

    @functools.wraps(original)
    async def request(self, method, url, **kwargs):
        recorder = _active()
        body = kwargs.get("json") if kwargs.get("json") is not None else kwargs.get("data")
        if isinstance(body, str):
            body = body.encode()
        call = _read_request(method, urlsplit(str(url)).path, body) if recorder is not None else None
        started = datetime.now()
        response = await original(self, method, url, **kwargs)
        if call is not None and not _failed(recorder, call[0], response.status):
            pending = _Pending(recorder, call[0], call[1], response.headers.get("content-type", ""), started)
            response.content = _AiohttpTee(response.content, pending)
        return response

    request.__art_capture__ = True  # type: ignore[attr-defined]
    lib.ClientSession._request = request


_INSTALL_LOCK = threading.Lock()
_INSTALLERS = {
    "httpx": _install_httpx,
    "httpx2": _install_httpx,
    "requests": _install_requests,
    "aiohttp": _install_aiohttp,
}


def _install() -> None:
    """Wrap the send method of every installed HTTP library once per process."""
    with _INSTALL_LOCK:
        for name, install in _INSTALLERS.items():
            if importlib.util.find_spec(name) is not None:
                install(importlib.import_module(name))
