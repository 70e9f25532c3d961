"""The items a conversation is made of, as `Trajectory` and `History` hold them: message dicts and
model `Choice`s (`messages_and_choices`), and tool lists. How they are validated and dumped (a
dumped Choice becomes one again), read as plain messages, and compared (`message_key`: what must
agree for a request message to be a recorded one)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, TypeGuard, cast

from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat.chat_completion import Choice
from pydantic import PlainSerializer, PlainValidator, ValidationError
from pydantic_core import to_jsonable_python

from .types import Messages, MessagesAndChoices, Tools


def is_choice(item: object) -> TypeGuard[Choice]:
    """True for a chat `Choice` (of any class with that shape: read as one), False for a message dict."""
    if isinstance(item, Choice):
        return True
    return not isinstance(item, Mapping) and hasattr(item, "message") and hasattr(item, "logprobs")


def _as_choice(item: Any) -> Any:
    # A Choice from another openai version or a subclass-free copy: re-home it in our Choice
    # class (extras such as token_ids survive) so isinstance checks downstream hold.
    if isinstance(item, Choice) or not hasattr(item, "model_dump"):
        return item
    try:
        return Choice.model_validate(item.model_dump())
    except Exception:
        return item


def _validate_items(value: Any) -> list[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"expected a list of message dicts and Choice objects, got {type(value).__name__}")
    items: list[Any] = []
    problems: list[str] = []
    for i, item in enumerate(value):
        if isinstance(item, Mapping) and "role" not in item and "message" in item:
            try:  # a dumped Choice becomes one again; one no Choice takes (ART's) stays as given
                items.append(Choice.model_validate(dict(item)))
            except ValidationError:
                items.append(dict(item))
        elif isinstance(item, Mapping):
            if "role" not in item:
                problems.append(f"item {i} is a dict without a 'role' key")
            items.append(item if isinstance(item, dict) else dict(item))
        elif is_choice(item):
            items.append(_as_choice(item))
        elif hasattr(item, "role") and hasattr(item, "content"):
            problems.append(
                f"item {i} is a {type(item).__name__}, not a Choice: append the Choice itself to train "
                "on it, or message.model_dump() to keep it as context"
            )
        else:
            problems.append(f"item {i} is a {type(item).__name__}, neither a message dict nor a Choice")
    if problems:
        raise ValueError("; ".join(problems))
    return items


def _dump_items(items: list[Any], info: Any) -> list[Any]:
    mode = getattr(info, "mode", "python")
    out = []
    for item in items:
        if is_choice(item) and hasattr(item, "model_dump"):
            out.append(item.model_dump(mode=mode))
        elif mode == "json":
            out.append(to_jsonable_python(item, serialize_unknown=True))
        else:
            out.append(dict(item) if isinstance(item, Mapping) else item)
    return out


def _validate_tools(value: Any) -> list[Any] | None:
    # Kept as given: validating against the TypedDict would drop keys newer APIs add.
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"expected a list of tool dicts or None, got {type(value).__name__}")
    tools = list(value)
    bad = [i for i, tool in enumerate(tools) if not isinstance(tool, Mapping)]
    if bad:
        raise ValueError(f"tools {bad} are not dicts")
    return tools


def _dump_tools(tools: list[Any] | None, info: Any) -> list[Any] | None:
    if tools is None or getattr(info, "mode", "python") != "json":
        return tools
    return to_jsonable_python(tools, serialize_unknown=True)


MessagesAndChoicesField = Annotated[  # the type of `messages_and_choices` fields
    MessagesAndChoices, PlainValidator(_validate_items), PlainSerializer(_dump_items)
]
ToolsField = Annotated[Tools | None, PlainValidator(_validate_tools), PlainSerializer(_dump_tools)]


def get_messages(messages_and_choices: Iterable[Any]) -> Messages:
    """Plain message dicts: each Choice becomes the assistant message it carries."""
    messages: Messages = []
    for item in messages_and_choices:
        if not is_choice(item):
            messages.append(item)
            continue
        message = item.message
        out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
        calls: list[Any] = getattr(message, "tool_calls", None) or []  # function tool calls: what chat models make
        if calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": call.type,
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in calls
            ]
        messages.append(cast(ChatCompletionMessageParam, out))  # the assistant message OpenAI's TypedDict describes
    return messages


def message_key(message: Mapping[str, Any]) -> tuple:
    """What must agree for a request message to be the recorded one. Libraries re-serialise
    history: content may come back as None or as text parts, tool arguments re-spaced.
    (art.verifiers matches verifiers' steps to recorded calls by the same key.)"""
    calls = tuple(
        ((call.get("function") or {}).get("name"), _json_key((call.get("function") or {}).get("arguments")))
        for call in message.get("tool_calls") or []
        if isinstance(call, Mapping)
    )
    return message.get("role"), message_text(message.get("content")), calls


def message_text(content: Any) -> str:
    """A message's content as one string: None is "", text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) if isinstance(part, Mapping) else str(getattr(part, "text", part))
            for part in content
        )
    return str(content)


def _json_key(text: Any) -> Any:
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except (TypeError, ValueError):
        return text


def tools_key(tools: Any) -> str:
    """A tool list as one comparable string (None and [] alike)."""
    return json.dumps(tools or [], sort_keys=True, default=str)
