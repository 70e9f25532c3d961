"""Automatic trajectory capture: record an agent's chat completions without rewriting the agent.

    trajectory = await art.trajectory(run_agent(scenario))   # ART's older name: capture_auto_trajectory
    trajectory.reward = score(...)   # or, inside the agent: art.current_trajectory(require=True).reward = ...
    group = await art.trajectory_group(art.trajectory(run_agent(s)) for _ in range(4))

While a capture is active in the current context (`contextvars`: it follows the task and the tasks
it starts), every chat completion sent through an `httpx` or `httpx2` client (the official
`openai` client uses one of them, newer releases the second; LangChain's `ChatOpenAI` and other
libraries built on it go through the same) is recorded: the request's messages as dicts, then the
`Choice` the server returned, with its token ids and logprobs, so a captured trajectory trains
like a hand-built one. Beside them, `trajectory.exchanges` keeps each call whole (request as sent,
`ChatCompletion` as received). A `stream=True` answer is read as server-sent events whatever
content type it came with, and rebuilt from its chunks into the `Choice` the same request
returns whole. A stream that ends with `[DONE]` without ever naming a `finish_reason` counts
as finished: "tool_calls" when tool calls streamed, else "stop" (its exchange keeps ART's
reading, "stop").

Calls to OpenAI's Responses API (`POST .../responses`, what the OpenAI Agents SDK sends) are
recorded the same way, through `art.responses_format`: the request's `instructions` and `input`
items as the chat messages they stand for, the `Response` (whole, or the one a stream's
`response.completed` event carries) as the chat `Choice` it came from, with the `token_ids`,
`prompt_token_ids`, logprobs and `step` our server puts on it; the call itself is in
`trajectory.exchanges.responses`.

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

import asyncio
import contextlib
import contextvars
import copy
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

from openai.types.chat.chat_completion import ChatCompletion, Choice
from openai.types.responses import Response

from .errors import CaptureError
from .responses_format import ResponsesFormatError, chat_messages, chat_tools, choice_from_response
from .trajectories import (
    ChatCompletionsExchange,
    ChatCompletionsRequest,
    ExceptionRecord,
    History,
    MetadataValue,
    MetricValue,
    ResponsesExchange,
    ResponsesRequest,
    Trajectory,
    TrajectoryGroup,
    get_messages,
)

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


def _current(require: bool, how: str) -> Trajectory | None:
    capture = _CURRENT.get()
    if capture is None:
        if require:
            raise CaptureError(f"no trajectory is being captured here: call {how} inside `art.trajectory(...)`, "
                               "`art.capture_auto_trajectory(...)` or `with art.AutoTrajectoryContext()` "
                               "(and not under `art.no_capture()`)")
        return None
    return capture.trajectory


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
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _check_coroutine(value: Any, name: str) -> None:
    # A Task or Future started already, in the context of whoever created it: a capture opened
    # now would never see its calls. ART refuses them the same way.
    if isinstance(value, asyncio.Future) or not isinstance(value, Coroutine):
        raise TypeError(f"{name}() takes the agent's coroutine itself, as in {name}(agent(...)); got "
                        f"{type(value).__name__}. A Task or Future runs in the context it was created "
                        "in, so a capture opened now would record none of its calls.")


async def trajectory(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    """Run `coroutine` (an agent) and return the trajectory of the chat completions it made
    (ART's name). Its return value is dropped; an exception it raises propagates."""
    _check_coroutine(coroutine, "trajectory")
    return await _captured(coroutine)


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    """ART's older name of `trajectory`."""
    _check_coroutine(coroutine, "capture_auto_trajectory")
    return await _captured(coroutine)


async def _captured(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    with AutoTrajectoryContext() as captured:
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
    with no_capture():
        try:
            for item in trajectories:
                if isinstance(item, (Trajectory, BaseException)):
                    _raise_interrupt(item)
                    results.append(item)
                    continue
                if not inspect.isawaitable(item):
                    raise TypeError(f"trajectory_group() takes trajectories, exceptions and awaitables of "
                                    f"trajectories; item {len(results)} is a {type(item).__name__}")
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
    return TrajectoryGroup([r for r in results if r is not None], exceptions=given,
                           metadata=metadata, metrics=metrics, logs=logs or ())


def _raise_interrupt(item: Any) -> None:
    if isinstance(item, BaseException) and not isinstance(item, Exception):
        raise item


def _outcome(task: asyncio.Future[Any], return_exceptions: bool) -> Trajectory | BaseException:
    try:
        result = task.result()
    except Exception as error:  # noqa: BLE001 - a failed rollout; cancellation and interrupts propagate
        if not return_exceptions:
            raise
        return error
    if not isinstance(result, Trajectory):
        raise TypeError(f"trajectory_group(): an awaitable gave a {type(result).__name__}, not a Trajectory")
    return result


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

    def record(self, request: dict[str, Any], headers: Mapping[str, str], content: bytes | Callable[[], bytes],
               started: datetime) -> None:
        """Add the call's new messages and choice 0 to the history it extends, and the call to
        `exchanges`. Never raises: the agent's call has succeeded whatever happens here."""
        try:
            self._record(request, headers, content() if callable(content) else content, started)
        except Exception as exc:  # noqa: BLE001 - a capture bug must not fail the agent's call
            log.exception("auto trajectory: recording a chat completion failed")
            self.note(f"recording a chat completion failed ({type(exc).__name__}: {exc}); not recorded")

    def _record(self, request: dict[str, Any], headers: Mapping[str, str], content: bytes,
                started: datetime) -> None:
        if _is_responses(request):
            self._record_response(request, headers, content, started)
            return
        try:
            answer, ended = _answer(request, headers, content)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.note(f"a chat completion's answer could not be read ({type(exc).__name__}: {exc}); not recorded")
            return
        choices = [c for c in answer["choices"] if isinstance(c, Mapping)]
        first = next((c for c in choices if c.get("index", 0) == 0), None)
        if first is None or (first.get("finish_reason") is None and not ended):
            # Only a stream can end this way: closed (or left unread) before its choice finished.
            self.note("a streamed chat completion ended before its choice finished; not recorded")
            return
        try:
            choice = Choice.model_validate(_finished(first, _said_why(first)))
        except ValueError as exc:
            self.note(f"a chat completion's choice is not an OpenAI Choice ({exc}); not recorded")
            return
        exchange = self._exchange(request, answer, started)
        if len(choices) > 1:
            self.note(f"a chat completion returned {len(choices)} choices (n > 1); only choice 0 is recorded")
        messages = [m for m in request.get("messages") or [] if isinstance(m, Mapping)]
        with self.lock:
            _place(self.trajectory, [dict(m) for m in messages], request.get("tools") or None, choice)
            if exchange is not None:
                self.trajectory._exchanges.append(exchange)

    def _record_response(self, request: dict[str, Any], headers: Mapping[str, str], content: bytes,
                         started: datetime) -> None:
        """A Responses API call: its input as chat messages, its Response as the chat Choice, the
        call itself in `exchanges.responses`."""
        try:
            response = _response_answer(request, headers, content)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.note(f"a response's answer could not be read ({type(exc).__name__}: {exc}); not recorded")
            return
        if response is None:
            self.note("a streamed response ended before it completed; not recorded")
            return
        if response.get("status") not in ("completed", "incomplete"):
            self.note(f"a response ended with status {response.get('status')!r}; not recorded")
            return
        try:
            messages = chat_messages(request)
            tools = chat_tools(request.get("tools"))
            choice = Choice.model_validate(choice_from_response(response))
        except (ResponsesFormatError, ValueError) as exc:
            self.note(f"a response could not be read as a chat turn ({exc}); not recorded")
            return
        # Built as the openai client builds what it receives (no validation): the Responses schema
        # grows fields that other servers (and older releases of ours) do not send.
        exchange = ResponsesExchange(request=ResponsesRequest(copy.deepcopy(request)),
                                     response=Response.construct(**response), start_time=started,
                                     end_time=datetime.now())
        with self.lock:
            _place(self.trajectory, messages, tools or None, choice)
            self.trajectory._exchanges.append(exchange)

    def _exchange(self, request: dict[str, Any], answer: dict[str, Any],
                  started: datetime) -> ChatCompletionsExchange | None:
        """The call as `trajectory.exchanges` shows it; None (and a note) when the answer is not
        a ChatCompletion (a server that leaves out `id` or `created`): its choice still counts.
        A choice that a stream never gave a reason reads "stop" here, as ART rebuilds it."""
        choices = [_finished(c, "stop") for c in answer["choices"] if isinstance(c, Mapping)]
        whole = {**answer, "choices": choices}
        try:
            response = ChatCompletion.model_validate(whole)
        except ValueError as exc:
            first_line = str(exc).splitlines()[0]
            self.note(f"a chat completion's answer is not an OpenAI ChatCompletion ({first_line}); its choice is "
                      "recorded, the call is not in trajectory.exchanges")
            return None
        return ChatCompletionsExchange(request=ChatCompletionsRequest(copy.deepcopy(request)), response=response,
                                       start_time=started, end_time=datetime.now())


def _said_why(choice: Mapping[str, Any]) -> str:
    """The finish reason of a stream that ended (`[DONE]`) without one: what the model did."""
    return "tool_calls" if (choice.get("message") or {}).get("tool_calls") else "stop"


def _finished(choice: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """`choice` with `reason` as its finish reason where it has none."""
    if choice.get("finish_reason") is not None:
        return dict(choice)
    return {**choice, "finish_reason": reason}


def _place(trajectory: Trajectory, messages: list[dict], tools: list | None, choice: Choice) -> None:
    """Append the request's new messages and `choice` to the longest history whose messages and
    tools begin the request's (the trajectory first when empty), or to a new additional history."""
    histories: list[Trajectory | History] = [trajectory, *trajectory.additional_histories]
    request = [message_key(m) for m in messages]
    target, best = None, -1
    for history in histories:
        items = history.messages_and_choices
        if not items or len(items) > len(messages) or _tools_key(history.tools) != _tools_key(tools):
            continue
        if [message_key(m) for m in get_messages(items)] == request[: len(items)] and len(items) > best:
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


def message_key(message: Mapping[str, Any]) -> tuple:
    """What must agree for a request message to be the recorded one. Libraries re-serialise
    history: content may come back as None or as text parts, tool arguments re-spaced.
    (art.verifiers matches verifiers' steps to recorded calls by the same key.)"""
    calls = tuple(
        ((call.get("function") or {}).get("name"), _json_key((call.get("function") or {}).get("arguments")))
        for call in message.get("tool_calls") or [] if isinstance(call, Mapping)
    )
    return message.get("role"), message_text(message.get("content")), calls


def message_text(content: Any) -> str:
    """A message's content as one string: None is "", text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) if isinstance(part, Mapping) else str(getattr(part, "text", part))
                       for part in content)
    return str(content)


def _json_key(text: Any) -> Any:
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except (TypeError, ValueError):
        return text


def _tools_key(tools: Any) -> str:
    return json.dumps(tools or [], sort_keys=True, default=str)


# -- reading answers ---------------------------------------------------------------------


def _answer(request: Mapping[str, Any], headers: Mapping[str, str], content: bytes) -> tuple[dict[str, Any], bool]:
    """The answer as one ChatCompletion dict, and whether it ended: a whole answer always has,
    a stream when it sent `[DONE]`. `stream=True` is read as server-sent events whatever the
    content type says (a bare server may send them as octet-stream or text/plain)."""
    if request.get("stream") is not True and "text/event-stream" not in headers.get("content-type", ""):
        answer = json.loads(content)
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            raise ValueError("the answer has no 'choices' list")
        return answer, True
    events, ended = _sse_data(content)
    failed = next((e["error"] for e in events if e.get("error")), None)
    if failed is not None:  # a failure after the 200 was sent ends the stream with an error event
        message = failed.get("message", failed) if isinstance(failed, dict) else failed
        raise ValueError(f"the stream ended with an error: {message}")
    return _whole(events, request), ended


def _is_responses(request: Mapping[str, Any]) -> bool:
    """A Responses API body (`input`), not a chat one (`messages`): `_chat_request` let only these two in."""
    return not isinstance(request.get("messages"), list)


def _response_answer(request: Mapping[str, Any], headers: Mapping[str, str], content: bytes) -> dict[str, Any] | None:
    """The Response a Responses call answered: the body, or the one a stream's last event
    (`response.completed`, `.incomplete` or `.failed`) carries; None for a stream cut before it."""
    if request.get("stream") is not True and "text/event-stream" not in headers.get("content-type", ""):
        response = json.loads(content)
    else:
        events, _ = _sse_data(content)
        ends = [e["response"] for e in events if str(e.get("type")) in _RESPONSE_ENDS]
        response = ends[-1] if ends else None
    if response is not None and not isinstance(response, dict):
        raise ValueError("the answer is not a Response object")
    return response


_RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def _whole(chunks: list[dict[str, Any]], request: Mapping[str, Any]) -> dict[str, Any]:
    """Chunks -> the ChatCompletion dict the same request returns whole: the first chunk's id,
    creation time and model, the last usage sent, the assembled choices."""
    def first(key: str, default: Any = None) -> Any:
        return next((c[key] for c in chunks if c.get(key) is not None), default)

    answer = {"id": first("id", ""), "object": "chat.completion", "created": first("created", 0),
              "model": first("model", request.get("model") or ""), "choices": assemble_stream(chunks)}
    for key in ("system_fingerprint", "service_tier"):
        if first(key) is not None:
            answer[key] = first(key)
    usage = [c["usage"] for c in chunks if c.get("usage") is not None]
    if usage:
        answer["usage"] = usage[-1]
    return answer


def _sse_data(content: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The JSON payloads of a server-sent event stream, and whether it sent `[DONE]`."""
    events, data, ended = [], [], False
    for line in content.decode("utf-8").splitlines() + [""]:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            payload = "\n".join(data)
            data = []
            if payload.strip() == "[DONE]":
                ended = True
            else:
                event = json.loads(payload)
                if isinstance(event, dict):
                    events.append(event)
    return events, ended


def assemble_stream(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat completion chunks (dicts) -> the choices the same request returns whole.

    Text and tool-call arguments are concatenated (a tool call's id and name are taken as
    sent, not repeated when a server sends them with every delta), logprobs entries and
    `token_ids` appended, and `prompt_token_ids` taken from wherever the stream sent them (each
    choice or the chunk), as is our server's `step` (the training step that sampled it). A
    choice the stream never gave a `finish_reason` keeps None.
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
    if isinstance(function.get("name"), str) and function["name"]:
        call["function"]["name"] = function["name"]
    if isinstance(function.get("arguments"), str):
        call["function"]["arguments"] += function["arguments"]


# -- the HTTP hook -----------------------------------------------------------------------


def _chat_request(request: Any) -> dict[str, Any] | None:
    """The JSON body of a chat completion (or Responses API) request, else None."""
    path = request.url.path.rstrip("/")
    if request.method != "POST" or not path.endswith(("/chat/completions", "/responses")):
        return None
    try:
        body = json.loads(request.content)
    except Exception:  # a streamed upload (not read yet) or not JSON: not a chat call we can read
        return None
    if not isinstance(body, dict):
        return None
    if path.endswith("/responses"):
        return body if isinstance(body.get("input"), (str, list)) and "messages" not in body else None
    return body if isinstance(body.get("messages"), list) else None


class _Pending:
    """A streamed answer being read: its bytes are kept until it ends or closes."""

    def __init__(self, capture: _Capture, lib: Any, request: dict, response: Any, started: datetime) -> None:
        self.capture, self.lib, self.request, self.response = capture, lib, request, response
        self.started = started
        self.parts: list[bytes] = []
        self.done = False
        capture.open.add(self)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.capture.open.discard(self)
        headers = self.response.headers
        self.capture.record(self.request, headers, lambda: _decoded(self.lib, headers, b"".join(self.parts)),
                            self.started)


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


def _observe(capture: _Capture, lib: Any, request: dict, response: Any, sync: bool, started: datetime) -> None:
    if not 200 <= response.status_code < 300:
        what = "a response" if _is_responses(request) else "a chat completion"
        capture.note(f"{what} failed with HTTP {response.status_code}; not recorded")
        return
    try:
        content = response.content  # read already: a whole (not streamed) answer
    except lib.ResponseNotRead:
        sync_tee, async_tee = _tees(lib)
        pending = _Pending(capture, lib, request, response, started)
        response.stream = (sync_tee if sync else async_tee)(response.stream, pending)
        return
    capture.record(request, response.headers, content, started)


def _hooked(lib: Any, original: Callable, sync: bool) -> Callable:
    if sync:
        @functools.wraps(original)
        def send(self, request, *args, **kwargs):
            capture = _CURRENT.get()
            body = _chat_request(request) if capture is not None else None
            started = datetime.now()
            response = original(self, request, *args, **kwargs)
            if body is not None:
                _observe(capture, lib, body, response, sync=True, started=started)
            return response
    else:
        @functools.wraps(original)
        async def send(self, request, *args, **kwargs):
            capture = _CURRENT.get()
            body = _chat_request(request) if capture is not None else None
            started = datetime.now()
            response = await original(self, request, *args, **kwargs)
            if body is not None:
                _observe(capture, lib, body, response, sync=False, started=started)
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
