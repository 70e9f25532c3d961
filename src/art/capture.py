"""Automatic trajectory capture: record an agent's chat completions without rewriting the agent.

    trajectory = await art.capture_auto_trajectory(run_agent(scenario))
    trajectory.reward = score(...)   # or, inside the agent: art.auto_trajectory(required=True).reward = ...

While a capture is active in the current context (`contextvars`: it follows the task and the tasks
it starts), every chat completion sent through an `httpx` or `httpx2` client (the official
`openai` client uses one of them, newer releases the second; LangChain's `ChatOpenAI` and other
libraries built on it go through the same) is recorded: the request's messages as dicts, then the
`Choice` the server returned, with its token ids and logprobs, so a captured trajectory trains
like a hand-built one. A streamed completion is rebuilt from its chunks into the `Choice` the
same request returns whole.

Each call joins the conversation it extends: the history (the trajectory itself or one of its
`additional_histories`) whose messages and tools begin the request's, the longest one when
several do. A call that extends none starts a new entry in `additional_histories`. Only
choice 0 of an `n > 1` call is recorded (as in OpenPipe ART); what is not recorded (the other
choices, a stream closed before it finished, an error answer) is said in `trajectory.logs`.

The hook wraps `Client.send` and `AsyncClient.send` of each HTTP library, installed when the first
capture starts (never at import) and inert outside a capture; it reads responses and changes
nothing the caller sees. Clients on other HTTP stacks (aiohttp) are not seen. This module knows
nothing of models, backends, training or torch.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.util
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, overload

from openai.types.chat.chat_completion import Choice

from .errors import CaptureError
from .trajectories import History, Trajectory, get_messages

log = logging.getLogger(__name__)

_CURRENT: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("art_auto_trajectory", default=None)


class AutoTrajectoryContext:
    """`with AutoTrajectoryContext() as trajectory:` records the chat completions made inside."""

    def __init__(self) -> None:
        self.trajectory = Trajectory()
        self._capture = _Capture(self.trajectory)

    def __enter__(self) -> Trajectory:
        _install()
        self._token = _CURRENT.set(self._capture)
        return self.trajectory

    def __exit__(self, *exc_info: Any) -> None:
        _CURRENT.reset(self._token)
        self._capture.flush()  # streams left open: what they carried in full still counts
        self.trajectory.finish()


@overload
def auto_trajectory(*, required: Literal[True]) -> Trajectory: ...
@overload
def auto_trajectory(*, required: bool = False) -> Trajectory | None: ...
def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """The trajectory being captured here (to set its reward or metrics), or None outside a
    capture; `required=True` raises CaptureError there instead."""
    capture = _CURRENT.get()
    if capture is None:
        if required:
            raise CaptureError("no trajectory is being captured here: call auto_trajectory(required=True) "
                               "inside `art.capture_auto_trajectory(...)` or `with art.AutoTrajectoryContext()`")
        return None
    return capture.trajectory


async def capture_auto_trajectory(coroutine: Awaitable[Any]) -> Trajectory:
    """Run `coroutine` (an agent) and return the trajectory of the chat completions it made.
    Its return value is dropped; an exception it raises propagates."""
    with AutoTrajectoryContext() as trajectory:
        await coroutine
    return trajectory


# -- recording ---------------------------------------------------------------------------


class _Capture:
    """One capture's state. Calls may finish on other threads (sync clients), hence the lock."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.lock = threading.Lock()
        self.open: set[_Pending] = set()

    def note(self, message: str) -> None:
        with self.lock:
            self.trajectory.log(message)
        log.debug("auto trajectory: %s", message)

    def flush(self) -> None:
        for pending in list(self.open):
            pending.finish()

    def record(self, request: dict[str, Any], headers: Mapping[str, str], content: bytes | Callable[[], bytes]) -> None:
        """Add the call's new messages and choice 0 to the history it extends. Never raises: the
        agent's call has succeeded whatever happens here."""
        try:
            self._record(request, headers, content() if callable(content) else content)
        except Exception as exc:  # noqa: BLE001 - a capture bug must not fail the agent's call
            log.exception("auto trajectory: recording a chat completion failed")
            self.note(f"recording a chat completion failed ({type(exc).__name__}: {exc}); not recorded")

    def _record(self, request: dict[str, Any], headers: Mapping[str, str], content: bytes) -> None:
        try:
            choices = _choices(headers, content)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.note(f"a chat completion's answer could not be read ({type(exc).__name__}: {exc}); not recorded")
            return
        first = next((c for c in choices if c.get("index", 0) == 0), None)
        if first is None or first.get("finish_reason") is None:
            # Only a stream can end this way: closed (or left unread) before its choice finished.
            self.note("a streamed chat completion ended before its choice finished; not recorded")
            return
        try:
            choice = Choice.model_validate(first)
        except ValueError as exc:
            self.note(f"a chat completion's choice is not an OpenAI Choice ({exc}); not recorded")
            return
        if len(choices) > 1:
            self.note(f"a chat completion returned {len(choices)} choices (n > 1); only choice 0 is recorded")
        messages = [m for m in request.get("messages") or [] if isinstance(m, Mapping)]
        with self.lock:
            _place(self.trajectory, [dict(m) for m in messages], request.get("tools") or None, choice)


def _place(trajectory: Trajectory, messages: list[dict], tools: list | None, choice: Choice) -> None:
    """Append the request's new messages and `choice` to the longest history whose messages and
    tools begin the request's (the trajectory first when empty), or to a new additional history."""
    histories: list[Trajectory | History] = [trajectory, *trajectory.additional_histories]
    request = [_key(m) for m in messages]
    target, best = None, -1
    for history in histories:
        items = history.messages_and_choices
        if not items or len(items) > len(messages) or _tools_key(history.tools) != _tools_key(tools):
            continue
        if [_key(m) for m in get_messages(items)] == request[: len(items)] and len(items) > best:
            target, best = history, len(items)
    if target is None:
        if not trajectory.messages_and_choices:
            target = trajectory
        else:
            target = History()
            trajectory.additional_histories.append(target)
    done = len(target.messages_and_choices)
    target.messages_and_choices = [*target.messages_and_choices, *messages[done:], choice]
    if done == 0:
        target.tools = tools


def _key(message: Mapping[str, Any]) -> tuple:
    """What must agree for a request message to be the recorded one. Libraries re-serialise
    history: content may come back as None or as text parts, tool arguments re-spaced."""
    calls = tuple(
        ((call.get("function") or {}).get("name"), _json_key((call.get("function") or {}).get("arguments")))
        for call in message.get("tool_calls") or [] if isinstance(call, Mapping)
    )
    return message.get("role"), _text(message.get("content")), calls


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, Mapping) else str(part) for part in content)
    return str(content)


def _json_key(text: Any) -> Any:
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except (TypeError, ValueError):
        return text


def _tools_key(tools: Any) -> str:
    return json.dumps(tools or [], sort_keys=True, default=str)


# -- reading answers ---------------------------------------------------------------------


def _choices(headers: Mapping[str, str], content: bytes) -> list[dict[str, Any]]:
    if "text/event-stream" not in headers.get("content-type", ""):
        return list(json.loads(content)["choices"])
    events = _sse_data(content)
    failed = next((e["error"] for e in events if e.get("error")), None)
    if failed is not None:  # a failure after the 200 was sent ends the stream with an error event
        message = failed.get("message", failed) if isinstance(failed, dict) else failed
        raise ValueError(f"the stream ended with an error: {message}")
    return assemble_stream(events)


def _sse_data(content: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, `[DONE]` left out."""
    events, data = [], []
    for line in content.decode("utf-8").splitlines() + [""]:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            payload = "\n".join(data)
            data = []
            if payload.strip() != "[DONE]":
                events.append(json.loads(payload))
    return events


def assemble_stream(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat completion chunks (dicts) -> the choices the same request returns whole.

    Text and tool-call arguments are concatenated, logprobs entries and `token_ids` appended,
    and `prompt_token_ids` taken from wherever the stream sent them (each choice or the chunk),
    as is our server's `step` (the training step that sampled it). A choice without a `finish_reason` did not finish (the stream was cut).
    """
    out: dict[int, dict[str, Any]] = {}
    prompt = step = None
    for chunk in chunks:
        prompt = chunk.get("prompt_token_ids", prompt)
        step = chunk.get("step", step)  # our server's: the training step that sampled it
        for part in chunk.get("choices") or []:
            choice = out.setdefault(part.get("index", 0), {
                "index": part.get("index", 0), "finish_reason": None, "logprobs": None,
                "message": {"role": "assistant", "content": None}})
            delta, message = part.get("delta") or {}, choice["message"]
            for field in ("content", "refusal", "reasoning_content"):
                if isinstance(delta.get(field), str):
                    message[field] = (message.get(field) or "") + delta[field]
            for call in delta.get("tool_calls") or []:
                _merge_call(message.setdefault("tool_calls", []), call)
            if (part.get("logprobs") or {}).get("content") is not None:
                logprobs = choice["logprobs"] or {"content": []}
                logprobs["content"] = (logprobs["content"] or []) + part["logprobs"]["content"]
                choice["logprobs"] = logprobs
            if part.get("token_ids") is not None:
                choice["token_ids"] = choice.get("token_ids", []) + list(part["token_ids"])
            if part.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = list(part["prompt_token_ids"])
            if part.get("finish_reason") is not None:
                choice["finish_reason"] = part["finish_reason"]
    for choice in out.values():
        if prompt is not None:
            choice.setdefault("prompt_token_ids", list(prompt))
        if isinstance(step, int):
            choice.setdefault("step", step)
        if choice["message"].get("tool_calls") and not choice["message"]["content"]:
            choice["message"]["content"] = None  # as whole answers write a call-only message
    return [out[i] for i in sorted(out)]


def _merge_call(calls: list[dict[str, Any]], delta: Mapping[str, Any]) -> None:
    index = delta.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call, function = calls[index], delta.get("function") or {}
    call["id"] = call["id"] or delta.get("id")
    call["type"] = delta.get("type") or call["type"]
    for field in ("name", "arguments"):
        if isinstance(function.get(field), str):
            call["function"][field] += function[field]


# -- the HTTP hook -----------------------------------------------------------------------


def _chat_request(request: Any) -> dict[str, Any] | None:
    """The JSON body of a chat completion request, else None."""
    if request.method != "POST" or not request.url.path.rstrip("/").endswith("/chat/completions"):
        return None
    try:
        body = json.loads(request.content)
    except Exception:  # a streamed upload (not read yet) or not JSON: not a chat call we can read
        return None
    return body if isinstance(body, dict) and isinstance(body.get("messages"), list) else None


class _Pending:
    """A streamed answer being read: its bytes are kept until it ends or closes."""

    def __init__(self, capture: _Capture, lib: Any, request: dict, response: Any) -> None:
        self.capture, self.lib, self.request, self.response = capture, lib, request, response
        self.parts: list[bytes] = []
        self.done = False
        capture.open.add(self)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.capture.open.discard(self)
        headers = self.response.headers
        self.capture.record(self.request, headers, lambda: _decoded(self.lib, headers, b"".join(self.parts)))


def _decoded(lib: Any, headers: Mapping[str, str], raw: bytes) -> bytes:
    """The body as the caller reads it: raw stream bytes may still be compressed."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    return lib.Response(200, headers={"content-encoding": encoding}, content=raw).read()


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


def _observe(capture: _Capture, lib: Any, request: dict, response: Any, sync: bool) -> None:
    if not 200 <= response.status_code < 300:
        capture.note(f"a chat completion failed with HTTP {response.status_code}; not recorded")
        return
    try:
        content = response.content  # read already: a whole (not streamed) answer
    except lib.ResponseNotRead:
        sync_tee, async_tee = _tees(lib)
        response.stream = (sync_tee if sync else async_tee)(response.stream, _Pending(capture, lib, request, response))
        return
    capture.record(request, response.headers, content)


def _hooked(lib: Any, original: Callable, sync: bool) -> Callable:
    if sync:
        @functools.wraps(original)
        def send(self, request, *args, **kwargs):
            capture = _CURRENT.get()
            body = _chat_request(request) if capture is not None else None
            response = original(self, request, *args, **kwargs)
            if body is not None:
                _observe(capture, lib, body, response, sync=True)
            return response
    else:
        @functools.wraps(original)
        async def send(self, request, *args, **kwargs):
            capture = _CURRENT.get()
            body = _chat_request(request) if capture is not None else None
            response = await original(self, request, *args, **kwargs)
            if body is not None:
                _observe(capture, lib, body, response, sync=False)
            return response
    send.__art_capture__ = True  # type: ignore[attr-defined]
    return send


_INSTALL_LOCK = threading.Lock()


def _install() -> None:
    """Wrap `send` of every installed httpx-like library once per process."""
    with _INSTALL_LOCK:
        for name in ("httpx", "httpx2"):
            if importlib.util.find_spec(name) is None:
                continue
            lib = importlib.import_module(name)
            for cls, sync in ((lib.Client, True), (lib.AsyncClient, False)):
                if not getattr(cls.send, "__art_capture__", False):
                    cls.send = _hooked(lib, cls.send, sync)
