"""The HTTP hooks of trajectory capture (`art.capture`): wrappers around the send methods of
`httpx` (and `httpx2`), `requests` and `aiohttp`, installed once per process when the first scope
opens, inert outside one. They copy what passes through (a stream as it is read) to the active
`Recorder` and change nothing the caller sees."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from .capture_recorder import PendingAnswer, Recorder, active_recorder, failed_call, read_request
from .exchanges import Endpoint

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
        def __init__(self, inner: Any, pending: PendingAnswer) -> None:
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
        def __init__(self, inner: Any, pending: PendingAnswer) -> None:
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
    recorder: Recorder, lib: Any, call: tuple[Endpoint, dict], response: Any, sync: bool, started: datetime
) -> None:
    endpoint, request = call
    if failed_call(recorder, endpoint, response.status_code):
        return
    content_type = response.headers.get("content-type", "")
    try:
        content = response.content  # read already: a whole (not streamed) answer
    except lib.ResponseNotRead:
        sync_tee, async_tee = _tees(lib)
        pending = PendingAnswer(
            recorder, endpoint, request, content_type, started, _httpx_decoder(lib, response.headers)
        )
        response.stream = (sync_tee if sync else async_tee)(response.stream, pending)
        return
    recorder.record(endpoint, request, content_type, content, started)


def _httpx_call(request: Any) -> tuple[Endpoint, dict] | None:
    try:
        content = request.content
    except Exception:  # a streamed upload, not read yet: not a call we can read
        return None
    return read_request(request.method, request.url.path, content)


def _httpx_hooked(lib: Any, original: Callable, sync: bool) -> Callable:
    if sync:

        @functools.wraps(original)
        def send(self, request, *args, **kwargs):
            recorder = active_recorder()
            call = _httpx_call(request) if recorder is not None else None
            started = datetime.now()
            response = original(self, request, *args, **kwargs)
            if call is not None:
                _httpx_observe(recorder, lib, call, response, sync=True, started=started)
            return response
    else:

        @functools.wraps(original)
        async def send(self, request, *args, **kwargs):
            recorder = active_recorder()
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

    def __init__(self, inner: Any, pending: PendingAnswer) -> None:
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
        recorder = active_recorder()
        call = (
            read_request(request.method or "", urlsplit(request.url).path, request.body)
            if recorder is not None
            else None
        )
        started = datetime.now()
        response = original(self, request, **kwargs)
        if call is not None and not failed_call(recorder, call[0], response.status_code):
            content_type = response.headers.get("content-type", "")
            if kwargs.get("stream"):
                pending = PendingAnswer(recorder, call[0], call[1], content_type, started)
                response.raw = _RequestsTee(response.raw, pending)
            else:
                recorder.record(call[0], call[1], content_type, response.content, started)
        return response

    send.__art_capture__ = True  # type: ignore[attr-defined]
    lib.Session.send = send


# -- aiohttp -----------------------------------------------------------------------------


class _AiohttpTee:
    """Stands in for an aiohttp response's `content` (a StreamReader), copying what is read."""

    def __init__(self, inner: Any, pending: PendingAnswer) -> None:
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
        recorder = active_recorder()
        body = kwargs.get("json") if kwargs.get("json") is not None else kwargs.get("data")
        if isinstance(body, str):
            body = body.encode()
        call = read_request(method, urlsplit(str(url)).path, body) if recorder is not None else None
        started = datetime.now()
        response = await original(self, method, url, **kwargs)
        if call is not None and not failed_call(recorder, call[0], response.status):
            pending = PendingAnswer(recorder, call[0], call[1], response.headers.get("content-type", ""), started)
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


def install_hooks() -> None:
    """Wrap the send method of every installed HTTP library once per process."""
    with _INSTALL_LOCK:
        for name, install in _INSTALLERS.items():
            if importlib.util.find_spec(name) is not None:
                install(importlib.import_module(name))
