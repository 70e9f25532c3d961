"""OpenAI's Responses API in terms of chat completions, both ways: the one translation that the
server (`POST /v1/responses`) and automatic capture (`art.capture`) share.

The server answers a Responses request by turning it into the chat-completions request it
means (`chat_request`), sampling that as any chat request, and writing the chat completion
back as a `Response` (`response_object`), or a chat stream's chunks as Responses stream
events (`art.responses_events`, built on `response_head` and `response_object`). Capture
reads the same request back into chat messages and the `Response` into the chat `Choice` it
came from (`choice_from_response`), so a trajectory recorded from an Agents SDK run is the
one a chat agent would have produced and trains on the sampled ids. Keeping both directions
here is what makes them agree: a request's items become the messages the prompt was rendered
from, and the next turn's items (the SDK sends the previous output back) become the same
messages again.

How items map:
- `instructions` -> a leading system message; `input` as a string -> one user message.
- a message item (`{"role", "content"}`, with or without `"type": "message"`) -> a chat message;
  its text parts (input_text, output_text, refusal) joined by newlines.
- `function_call` items -> `tool_calls` of one assistant message (the one just before, when an
  assistant message or another call precedes), `call_id` as the call's id.
- `function_call_output` -> a `tool` message; `reasoning` items are skipped (nothing here
  produces them).
- a chat choice -> one assistant `message` item (absent when the choice only calls tools), then
  one `function_call` item per tool call; finish "length" -> status "incomplete".

Beside OpenAI's fields a `Response` from our server carries the chat choice's training fields
at its top level: `token_ids`, `prompt_token_ids`, `logprobs` (the chat shape,
`{"content": [...]}`, one entry per sampled token) and `step`. They stay off the output items
on purpose: agent libraries send output items back as the next input, and would send them too.

Bad input raises `ResponsesFormatError`, whose `param` names the field (`input[2].content[0].type`).
Nothing here knows HTTP, models or torch.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

TEXT_PARTS = ("input_text", "output_text", "text")
"""Content part types read as text (`refusal` parts too, by their `refusal` field)."""
LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The `include` entry that asks for logprobs on output text, as OpenAI names it."""


class ResponsesFormatError(ValueError):
    """A Responses request that cannot be read as a chat request; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (`resp_`, `msg_`, `fc_` and 24 hex digits)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- request: Responses -> chat ------------------------------------------------------------


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Responses request's `instructions` and `input` stand for."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    elif isinstance(instructions, list):
        messages += _items(instructions, "instructions")
    elif instructions is not None:
        raise ResponsesFormatError("instructions must be a string or a list of message items", "instructions")
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += _items(given, "input")
    else:
        raise ResponsesFormatError("input must be a string or a list of items", "input")
    if not messages:
        raise ResponsesFormatError("input must hold at least one message (or give instructions)", "input")
    return messages


def _items(items: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    calls_join = False  # out[-1] is an assistant message that following function_call items join
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise ResponsesFormatError(f"{at} must be an object (a message or a function call item)", at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesFormatError(
                    f"{at}.role must be 'user', 'system', 'developer' or 'assistant', got {_show(role)}", f"{at}.role"
                )
            out.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
            calls_join = role == "assistant"
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", at),
                "type": "function",
                "function": {
                    "name": _string(item, "name", at),
                    "arguments": _string(item, "arguments", at, empty=True),
                },
            }
            if calls_join:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls_join = True
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", at),
                    "content": output if isinstance(output, str) else _text(output, f"{at}.output"),
                }
            )
            calls_join = False
        elif kind == "reasoning":
            continue  # a model's hidden reasoning, replayed by some clients; ours produce none
        elif kind == "item_reference":
            raise ResponsesFormatError(
                f"{at}: item references need stored responses, which this server does not keep; send the item itself",
                f"{at}.type",
            )
        else:
            raise ResponsesFormatError(
                f"{at}.type {_show(kind)} is not supported: only message, function_call "
                "and function_call_output items are",
                f"{at}.type",
            )
    return out


def _string(item: Mapping[str, Any], key: str, at: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (value or empty):
        raise ResponsesFormatError(f"{at}.{key} must be a{'' if empty else ' non-empty'} string", f"{at}.{key}")
    return value


def _text(content: Any, at: str) -> str:
    """A message's content as one string: text parts joined by newlines (as chat's are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesFormatError(f"{at} must be a string or a list of text parts", at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in (*TEXT_PARTS, "refusal"):
            raise ResponsesFormatError(
                f"{at}[{j}].type {_show(kind)} is not supported: only text parts (input_text, output_text) are",
                f"{at}[{j}].type",
            )
        if not isinstance(part.get(key), str):
            raise ResponsesFormatError(f"{at}[{j}].{key} must be a string", f"{at}[{j}].{key}")
        texts.append(part[key])
    return "\n".join(texts)


_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools (`{"type": "function", "function": {...}}`)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ResponsesFormatError("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ResponsesFormatError(f"{at} must be an object", at)
        if tool.get("type") != "function":
            raise ResponsesFormatError(
                f"{at}.type {_show(tool.get('type'))} is not supported: only function tools "
                "are (hosted tools run on OpenAI's side)",
                f"{at}.type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ResponsesFormatError(f"{at}.name must be a non-empty string", f"{at}.name")
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if tool.get(key) is not None and not isinstance(tool[key], kind):
                what = "JSON schema object" if kind is dict else kind.__name__
                raise ResponsesFormatError(f"{at}.{key} must be a {what}", f"{at}.{key}")
        # The function's fields in the order given: the prompt shows the tool as JSON.
        function = {key: value for key, value in tool.items() if key in _FUNCTION_FIELDS and value is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    """ "none", "auto", "required" pass; `{"type": "function", "name": n}` names a chat function."""
    if choice is None or choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ResponsesFormatError("tool_choice 'required' needs tools", "tool_choice")
        return choice
    name = choice.get("name") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ResponsesFormatError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
            f"'name': ...}}, got {_show(choice)}",
            "tool_choice",
        )
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise ResponsesFormatError(
            f"tool_choice names {_show(name)}, which is not among the tools {names}", "tool_choice"
        )
    return {"type": "function", "function": {"name": name}}


def chat_response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise ResponsesFormatError("text must be an object such as {'format': {'type': 'text'}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ResponsesFormatError(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {_show(kind)}", "text.format.type"
        )
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise ResponsesFormatError("text.format.schema must be a JSON schema object", "text.format.schema")
    name = fmt.get("name", "response")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise ResponsesFormatError("text.format.name must be a string of 1 to 64 characters", "text.format.name")
    spec = {"name": name, "schema": dict(schema)}
    for key in ("description", "strict"):
        if fmt.get(key) is not None:
            spec[key] = fmt[key]
    return {"type": "json_schema", "json_schema": spec}


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions request body a Responses request means (one choice; a stream asks
    for usage, which a Response always has). Our extensions `seed`, `stop` and
    `chat_template_kwargs` pass through."""
    tools = chat_tools(body.get("tools"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages(body)}
    if tools:
        chat["tools"] = tools
    choice = chat_tool_choice(body.get("tool_choice"), tools)
    if choice is not None and tools:
        chat["tool_choice"] = choice
    response_format = chat_response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    renamed = {"max_output_tokens": "max_completion_tokens"}
    for key in (
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "max_output_tokens",
        "seed",
        "stop",
        "chat_template_kwargs",
        "user",
    ):
        if body.get(key) is not None:
            chat[renamed.get(key, key)] = body[key]
    if body.get("top_logprobs"):
        chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
    if body.get("stream"):
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat


# -- answer: chat -> Responses ---------------------------------------------------------------


def _usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _echo(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request settings a Response repeats back."""
    tools = [
        {
            "type": "function",
            "name": t.get("name"),
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
        }
        for t in body.get("tools") or []
    ]
    parallel = body.get("parallel_tool_calls")
    return {
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": True if parallel is None else bool(parallel),
        "temperature": _given(body, "temperature", 1.0),
        "top_p": _given(body, "top_p", 1.0),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": tools,
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": None,
        "reasoning": body.get("reasoning"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "top_logprobs": body.get("top_logprobs"),
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
        "background": False,
        "store": bool(body.get("store", False)),
    }


def _given(body: Mapping[str, Any], key: str, default: Any) -> Any:
    return default if body.get(key) is None else body[key]


def response_head(
    body: Mapping[str, Any], response_id: str, created_at: float, model: str, status: str = "in_progress"
) -> dict[str, Any]:
    """A Response with no output yet (what a stream's first events carry)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        "usage": None,
        **_echo(body),
    }


def output_items(
    choice: Mapping[str, Any], body: Mapping[str, Any], message_id: str | None = None, call_ids: list[str] | None = None
) -> list[dict[str, Any]]:
    """A chat choice as Responses output items: its text as one message (none when the choice
    only calls tools), then one function_call per tool call. The output text carries logprobs
    only when `include` asks for them and the text is the whole completion (no calls)."""
    message = choice.get("message") or {}
    content, calls = message.get("content"), message.get("tool_calls") or []
    incomplete = choice.get("finish_reason") == "length"
    items: list[dict[str, Any]] = []
    if content or not calls:  # a call-only choice has no message; any other has one, maybe empty
        logprobs = []
        if LOGPROBS_INCLUDE in (body.get("include") or []) and not calls:
            logprobs = list((choice.get("logprobs") or {}).get("content") or [])
        items.append(
            {
                "id": message_id or new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "incomplete" if incomplete else "completed",
                "content": [{"type": "output_text", "text": content or "", "annotations": [], "logprobs": logprobs}],
            }
        )
    for j, call in enumerate(calls):
        function = call.get("function") or {}
        items.append(
            {
                "id": call_ids[j] if call_ids and j < len(call_ids) else new_id("fc"),
                "type": "function_call",
                "call_id": call.get("id") or new_id("call"),
                "name": function.get("name", ""),
                "arguments": function.get("arguments", ""),
                "status": "completed",
            }
        )
    return items


def response_object(
    completion: Mapping[str, Any],
    body: Mapping[str, Any],
    *,
    response_id: str | None = None,
    message_id: str | None = None,
    call_ids: list[str] | None = None,
) -> dict[str, Any]:
    """A chat completion (our server's dict, choice 0) as the Response the request asked for,
    with the choice's training fields beside OpenAI's (`token_ids`, `prompt_token_ids`,
    `logprobs`, `step`; `replica` when the server has several)."""
    choice = (completion.get("choices") or [{}])[0]
    incomplete = choice.get("finish_reason") == "length"
    response = response_head(
        body,
        response_id or new_id("resp"),
        completion.get("created") or time.time(),
        completion.get("model") or body.get("model") or "",
        status="incomplete" if incomplete else "completed",
    )
    response.update(
        {
            "completed_at": time.time(),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output_items(choice, body, message_id, call_ids),
            "usage": _usage(completion.get("usage")),
            "token_ids": list(choice.get("token_ids") or []),
            "prompt_token_ids": list(choice.get("prompt_token_ids") or completion.get("prompt_token_ids") or []),
            "logprobs": choice.get("logprobs"),
        }
    )
    step = choice.get("step", completion.get("step"))
    if step is not None:
        response["step"] = step
    if completion.get("replica") is not None:
        response["replica"] = completion["replica"]
    return response


def choice_from_response(response: Mapping[str, Any]) -> dict[str, Any]:
    """A Response (a dict) as the chat `Choice` (a dict) it stands for: the output text as the
    content (None when the output only calls tools), function_call items as tool calls, the
    finish reason from the status ("length" when incomplete), and our server's `token_ids`,
    `prompt_token_ids`, `logprobs` and `step` when it sent them."""
    texts, calls = [], []
    for item in response.get("output") or []:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "message":
            texts += [
                part.get("text") or ""
                for part in item.get("content") or []
                if isinstance(part, Mapping) and part.get("type") == "output_text"
            ]
        elif item.get("type") == "function_call":
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            )
    status = response.get("status")
    if status == "incomplete":
        finish = "length"
    else:
        finish = "tool_calls" if calls else "stop"
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish,
        "logprobs": response.get("logprobs"),
    }
    for key in ("token_ids", "prompt_token_ids", "step"):
        if response.get(key) is not None:
            choice[key] = response[key]
    return choice
