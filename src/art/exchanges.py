"""One model call as a capture saw it: the request body sent and the response received.

Four APIs, as in OpenPipe ART: Chat Completions, Completions, Responses and Anthropic Messages.
An exchange keeps the request as the plain dict that was sent (mutable, unvalidated: servers take
fields no schema knows) and the response as the SDK's type, a stream rebuilt into the whole answer
the same request returns without `stream`. `build_exchange` does that rebuilding from the raw
body; it raises `IncompleteExchange` for a call that failed or a stream that stopped before its
end, which a capture leaves out. Nothing here knows trajectories, HTTP clients or training.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

import pydantic
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from typing_extensions import TypedDict

if TYPE_CHECKING:
    from anthropic.types import Message as AnthropicMessage

Endpoint = Literal["chat_completions", "completions", "responses", "messages"]


class ChatCompletionsRequest(TypedDict, total=False, extra_items=Any):  # type: ignore[call-arg]  # PEP 728, not in mypy yet
    """The JSON body of a Chat Completions request (`POST /v1/chat/completions`)."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool
    tools: list[dict[str, Any]]
    max_completion_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    logprobs: bool
    top_logprobs: int
    chat_template: str
    chat_template_kwargs: dict[str, Any]


class CompletionsRequest(TypedDict, total=False, extra_items=Any):  # type: ignore[call-arg]  # PEP 728, not in mypy yet
    """The JSON body of a Completions request (`POST /v1/completions`)."""

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool
    max_tokens: int
    temperature: float
    top_p: float
    logprobs: int
    echo: bool
    stop: str | list[str]
    seed: int
    suffix: str


class ResponsesRequest(TypedDict, total=False, extra_items=Any):  # type: ignore[call-arg]  # PEP 728, not in mypy yet
    """The JSON body of a Responses request (`POST /v1/responses`)."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str
    previous_response_id: str
    conversation: Any
    stream: bool
    tools: list[dict[str, Any]]
    max_output_tokens: int
    temperature: float
    top_p: float
    chat_template: str
    chat_template_kwargs: dict[str, Any]


class MessagesRequest(TypedDict, total=False, extra_items=Any):  # type: ignore[call-arg]  # PEP 728, not in mypy yet
    """The JSON body of an Anthropic Messages request (`POST /v1/messages`)."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    stream: bool
    system: str | list[dict[str, Any]]
    tools: list[dict[str, Any]]
    thinking: dict[str, Any]
    temperature: float
    top_p: float
    top_k: int
    stop_sequences: list[str]
    chat_template: str
    chat_template_kwargs: dict[str, Any]


# The request stays the dict that was sent: validating it against the TypedDict would drop the
# keys servers add (vLLM's `chat_template_kwargs`, ours `extra_body` fields).
_RequestField = Annotated[dict[str, Any], pydantic.SkipValidation]


def anthropic_message_type() -> type[AnthropicMessage]:
    """`anthropic.types.Message`, imported on first use: the anthropic package takes over a second
    to import, which every `import art` (every rollout process) paid though few runs call Anthropic."""
    from anthropic.types import Message

    return Message


def _as_anthropic_message(value: Any) -> AnthropicMessage:
    message = anthropic_message_type()
    return value if isinstance(value, message) else message.model_validate(value)


_AnthropicMessageField = Annotated[Any, pydantic.AfterValidator(_as_anthropic_message)]
"""An `anthropic.types.Message`, validated as one; dumped as any pydantic model is."""


class _Exchange(pydantic.BaseModel):
    request: _RequestField
    start_time: datetime
    end_time: datetime
    if TYPE_CHECKING:  # each exchange kind declares its own (typed) response field
        response: Any

    @pydantic.computed_field  # type: ignore[prop-decorator]  # mypy refuses a decorator on a property
    @property
    def model(self) -> str | None:
        """The model asked for, else the one that answered."""
        asked = self.request.get("model")
        return asked if isinstance(asked, str) else getattr(self.response, "model", None)


class ChatCompletionsExchange(_Exchange):
    """A Chat Completions call: the request and the `ChatCompletion` (a stream's, rebuilt)."""

    response: ChatCompletion


class CompletionsExchange(_Exchange):
    """A Completions call: the request and the `Completion` (a stream's, rebuilt)."""

    response: Completion


class ResponsesExchange(_Exchange):
    """A Responses call: the request and the `Response` (a stream's: the one its last event carried)."""

    response: Response


class MessagesExchange(_Exchange):
    """An Anthropic Messages call: the request and the `Message` (a stream's, rebuilt)."""

    if TYPE_CHECKING:
        response: AnthropicMessage
    else:
        response: _AnthropicMessageField


Exchange = ChatCompletionsExchange | CompletionsExchange | ResponsesExchange | MessagesExchange


class TrajectoryExchanges(pydantic.BaseModel):
    """The calls behind a captured trajectory, one list per API, each in the order calls finished."""

    chat_completions: list[ChatCompletionsExchange] = pydantic.Field(default_factory=list)
    completions: list[CompletionsExchange] = pydantic.Field(default_factory=list)
    responses: list[ResponsesExchange] = pydantic.Field(default_factory=list)
    messages: list[MessagesExchange] = pydantic.Field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.chat_completions or self.completions or self.responses or self.messages)

    def add(self, exchange: Exchange) -> None:
        self.list_for(exchange).append(exchange)

    def list_for(self, exchange: Exchange) -> list[Any]:
        return getattr(self, ENDPOINT_OF[type(exchange)])

    def in_order(self) -> list[Exchange]:
        """Every exchange, all APIs together, in the order the calls finished."""
        every: list[Exchange] = [*self.chat_completions, *self.completions, *self.responses, *self.messages]
        return sorted(every, key=lambda exchange: exchange.end_time)


ENDPOINT_OF: dict[type, Endpoint] = {
    ChatCompletionsExchange: "chat_completions",
    CompletionsExchange: "completions",
    ResponsesExchange: "responses",
    MessagesExchange: "messages",
}


class IncompleteExchange(ValueError):
    """The call has no whole answer to keep: an error body or a stream cut before its end."""


# -- which API a request is ------------------------------------------------------------------


def endpoint_of(path: str, body: Mapping[str, Any]) -> Endpoint | None:
    """The API a `POST` to `path` with JSON `body` calls, or None when it is none of the four
    (or a body one of them would refuse, so no answer is worth reading)."""
    path = path.rstrip("/")
    if path.endswith("/chat/completions"):
        return "chat_completions" if isinstance(body.get("messages"), list) else None
    if path.endswith("/completions"):
        return "completions" if "prompt" in body else None
    if path.endswith("/responses"):
        return "responses" if isinstance(body.get("input"), (str, list)) and "messages" not in body else None
    if path.endswith("/messages"):
        return "messages" if isinstance(body.get("messages"), list) else None
    return None


# -- rebuilding answers ----------------------------------------------------------------------


def build_exchange(
    endpoint: Endpoint,
    request: Mapping[str, Any],
    body: bytes,
    *,
    start_time: datetime,
    end_time: datetime,
    content_type: str = "",
) -> tuple[Endpoint, Exchange]:
    """`(endpoint, exchange)` from a call's request and the raw bytes of its answer, whole or
    streamed (`stream: true`, or a `text/event-stream` answer). Raises IncompleteExchange when
    the answer is an error or a stream that did not finish, ValueError when it is not the API's."""
    streamed = request.get("stream") is True or "text/event-stream" in content_type
    kept = copy.deepcopy(dict(request))
    times = {"start_time": start_time, "end_time": end_time}
    if endpoint == "chat_completions":
        answer = stream_chat_completion(body, request) if streamed else _json_object(body, "choices")
        return endpoint, ChatCompletionsExchange(request=kept, response=ChatCompletion.model_validate(answer), **times)
    if endpoint == "completions":
        answer = stream_completion(body, request) if streamed else _json_object(body, "choices")
        return endpoint, CompletionsExchange(request=kept, response=Completion.model_validate(answer), **times)
    if endpoint == "responses":
        answer = stream_response(body) if streamed else _json_object(body, "output")
        # Built as the openai client builds what it receives (no validation): the Responses
        # schema grows fields other servers, and older releases of ours, do not send.
        return endpoint, ResponsesExchange(request=kept, response=Response.construct(**answer), **times)
    answer = stream_message(body) if streamed else _json_object(body, "content")
    return endpoint, MessagesExchange(request=kept, response=anthropic_message_type().model_validate(answer), **times)


def _json_object(body: bytes, required: str) -> dict[str, Any]:
    try:
        answer = json.loads(body)
    except ValueError as exc:
        raise IncompleteExchange(f"an answer is not JSON ({exc})") from None
    if not isinstance(answer, dict) or required not in answer:
        raise IncompleteExchange(f"an answer has no {required!r}: an error, or not this API's answer")
    return answer


def sse_events(body: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The JSON payloads of a server-sent event stream, and whether it sent `[DONE]`."""
    events, data, ended = [], [], False
    for line in body.decode("utf-8").splitlines() + [""]:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            payload = "\n".join(data)
            data = []
            if payload.strip() == "[DONE]":
                ended = True
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events, ended


def _raise_stream_error(events: list[dict[str, Any]]) -> None:
    # A failure after the 200 was sent ends the stream with an error event.
    for event in events:
        failed = event.get("error")
        if failed:
            message = failed.get("message", failed) if isinstance(failed, dict) else failed
            raise IncompleteExchange(f"a stream ended with an error: {message}")


def _first(chunks: list[dict[str, Any]], key: str, default: Any = None) -> Any:
    return next((c[key] for c in chunks if c.get(key) is not None), default)


def stream_chat_completion(body: bytes, request: Mapping[str, Any]) -> dict[str, Any]:
    """A Chat Completions stream -> the ChatCompletion dict the request returns whole. A choice
    that a stream ending in `[DONE]` never gave a reason reads "stop", as ART rebuilds it."""
    chunks, ended = sse_events(body)
    _raise_stream_error(chunks)
    choices = assemble_chat_stream(chunks)
    first = next((c for c in choices if c["index"] == 0), None)
    if first is None or (first["finish_reason"] is None and not ended):
        raise IncompleteExchange("a streamed chat completion ended before its choice finished")
    for choice in choices:
        choice["finish_reason"] = choice["finish_reason"] or "stop"
    answer = {
        "id": _first(chunks, "id", ""),
        "object": "chat.completion",
        "created": _first(chunks, "created", 0),
        "model": _first(chunks, "model", request.get("model") or ""),
        "choices": choices,
    }
    for key in ("system_fingerprint", "service_tier"):
        if _first(chunks, key) is not None:
            answer[key] = _first(chunks, key)
    usage = [c["usage"] for c in chunks if c.get("usage") is not None]
    if usage:
        answer["usage"] = usage[-1]
    return answer


def assemble_chat_stream(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
        step = chunk.get("step", step)
        for part in chunk.get("choices") or []:
            choice = out.setdefault(
                part.get("index", 0),
                {
                    "index": part.get("index", 0),
                    "finish_reason": None,
                    "logprobs": None,
                    "message": {"role": "assistant", "content": None},
                },
            )
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
            if "stop_reason" in part:  # vLLM's (and ours): the stop string or id that ended it
                choice["stop_reason"] = part["stop_reason"]
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


def stream_completion(body: bytes, request: Mapping[str, Any]) -> dict[str, Any]:
    """A Completions stream -> the Completion dict: text, `token_ids` and the logprobs lists
    concatenated per choice; "stop" for a choice a stream ending in `[DONE]` gave no reason."""
    chunks, ended = sse_events(body)
    _raise_stream_error(chunks)
    out: dict[int, dict[str, Any]] = {}
    prompt = step = None
    for chunk in chunks:
        prompt = chunk.get("prompt_token_ids", prompt)
        step = chunk.get("step", step)
        for part in chunk.get("choices") or []:
            choice = out.setdefault(
                part.get("index", 0),
                {"index": part.get("index", 0), "text": "", "finish_reason": None, "logprobs": None},
            )
            choice["text"] += part.get("text") or ""
            if part.get("token_ids") is not None:
                choice["token_ids"] = choice.get("token_ids", []) + list(part["token_ids"])
            if part.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = list(part["prompt_token_ids"])
            logprobs = part.get("logprobs")
            if isinstance(logprobs, Mapping):
                merged = choice["logprobs"] or {
                    "tokens": [],
                    "token_logprobs": [],
                    "top_logprobs": [],
                    "text_offset": [],
                }
                for key in merged:
                    merged[key] = (merged[key] or []) + list(logprobs.get(key) or [])
                choice["logprobs"] = merged
            if part.get("finish_reason") is not None:
                choice["finish_reason"] = part["finish_reason"]
            if "stop_reason" in part:
                choice["stop_reason"] = part["stop_reason"]
    first = out.get(0)
    if first is None or (first["finish_reason"] is None and not ended):
        raise IncompleteExchange("a streamed completion ended before its choice finished")
    for choice in out.values():
        choice["finish_reason"] = choice["finish_reason"] or "stop"
        if prompt is not None:
            choice.setdefault("prompt_token_ids", list(prompt))
        if isinstance(step, int):
            choice.setdefault("step", step)
    answer = {
        "id": _first(chunks, "id", ""),
        "object": "text_completion",
        "created": _first(chunks, "created", 0),
        "model": _first(chunks, "model", request.get("model") or ""),
        "choices": [out[i] for i in sorted(out)],
    }
    usage = [c["usage"] for c in chunks if c.get("usage") is not None]
    if usage:
        answer["usage"] = usage[-1]
    return answer


_RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def stream_response(body: bytes) -> dict[str, Any]:
    """A Responses stream -> the Response its last event (`response.completed`, `.incomplete`
    or `.failed`) carries."""
    events, _ = sse_events(body)
    ends = [
        e["response"] for e in events if str(e.get("type")) in _RESPONSE_ENDS and isinstance(e.get("response"), dict)
    ]
    if not ends:
        raise IncompleteExchange("a streamed response ended before it completed")
    return ends[-1]


def stream_message(body: bytes) -> dict[str, Any]:
    """An Anthropic Messages stream -> the Message dict: `message_start`'s message, each content
    block from its start and deltas (text, tool input JSON, thinking), `message_delta`'s stop
    reason, usage and any extra fields (a server's `token_ids`, `logprobs`); `message_stop` ends it."""
    events, _ = sse_events(body)
    _raise_stream_error(events)
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    partial_json: dict[int, str] = {}
    stopped = False
    for event in events:
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            message = copy.deepcopy(event["message"])
        elif kind == "content_block_start":
            blocks[event.get("index", len(blocks))] = copy.deepcopy(event.get("content_block") or {})
        elif kind == "content_block_delta":
            index, delta = event.get("index", 0), event.get("delta") or {}
            block = blocks.setdefault(index, {"type": "text", "text": ""})
            if delta.get("type") == "input_json_delta":
                partial_json[index] = partial_json.get(index, "") + (delta.get("partial_json") or "")
            for field, key in (("text", "text"), ("thinking", "thinking"), ("signature", "signature")):
                if isinstance(delta.get(key), str):
                    block[field] = (block.get(field) or "") + delta[key]
        elif kind == "message_delta" and message is not None:
            message.update({k: v for k, v in (event.get("delta") or {}).items()})
            usage = {**(message.get("usage") or {}), **(event.get("usage") or {})}
            message["usage"] = usage
            for key, value in event.items():
                if key not in ("type", "delta", "usage"):
                    message[key] = value
        elif kind == "message_stop":
            stopped = True
    if message is None or not stopped:
        raise IncompleteExchange("a streamed message ended before message_stop")
    for index, text in partial_json.items():
        try:
            blocks[index]["input"] = json.loads(text) if text else {}
        except ValueError:
            raise ValueError(f"content block {index}: the streamed tool input is not JSON") from None
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message
