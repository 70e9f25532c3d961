"""An exchange as the chat turn it stands for: the request's messages and tools, and the answer
as the chat `Choice` that trains.

Training reads exact token ids off chat `Choice`s (`prompt_token_ids`, `token_ids`, logprobs), so
every API's call becomes one: a Chat Completions choice as it is; a Responses call through
`art.responses_format`; a Completions choice with its prompt as one user message (its prompt ids
say what the model saw, so the message is only what the dashboard shows); an Anthropic Messages
call with its system prompt, content blocks and tools in OpenAI's chat shapes, and the `Message`
as the choice (`token_ids`, `prompt_token_ids` and `logprobs` read from the extra fields a
vLLM-style server adds, ours included). A call whose answer is not a finished turn raises
`NotATurn` with the reason, which a capture writes in the trajectory's logs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion import Choice

from art.types import as_dict

from .exchanges import ChatCompletionsExchange, CompletionsExchange, Exchange, MessagesExchange, ResponsesExchange
from .responses_format import ResponsesFormatError, chat_messages, chat_tools, choice_from_response


class NotATurn(ValueError):
    """The exchange holds nothing to train (an unfinished or unreadable answer)."""


@dataclass
class ChatTurn:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    choice: Choice
    notes: list[str] = field(default_factory=list)
    """What was left out (the other choices of an n > 1 call)."""


def chat_turn(exchange: Exchange) -> ChatTurn:
    """The chat turn `exchange` stands for; NotATurn when it has none."""
    if isinstance(exchange, ChatCompletionsExchange):
        return _chat(exchange)
    if isinstance(exchange, CompletionsExchange):
        return _completion(exchange)
    if isinstance(exchange, ResponsesExchange):
        return _response(exchange)
    return _message(exchange)


def _dump(model: Any) -> dict[str, Any]:
    return as_dict(model, mode="json", warnings=False)


def _choice0(choices: list[dict[str, Any]], what: str) -> tuple[dict[str, Any], list[str]]:
    first = next((c for c in choices if c.get("index", 0) == 0), None)
    if first is None:
        raise NotATurn(f"a {what} answer has no choice 0")
    notes = [f"a {what} returned {len(choices)} choices (n > 1); only choice 0 is recorded"] if len(choices) > 1 else []
    return first, notes


def _chat(exchange: ChatCompletionsExchange) -> ChatTurn:
    first, notes = _choice0(_dump(exchange.response)["choices"], "chat completion")
    if first.get("finish_reason") == "stop" and (first.get("message") or {}).get("tool_calls"):
        first["finish_reason"] = "tool_calls"  # what a stream that never named its reason did
    messages = [dict(m) for m in exchange.request.get("messages") or [] if isinstance(m, Mapping)]
    return ChatTurn(messages, exchange.request.get("tools") or None, Choice.model_validate(first), notes)


def _response(exchange: ResponsesExchange) -> ChatTurn:
    response = _dump(exchange.response)
    if response.get("status") not in ("completed", "incomplete"):
        raise NotATurn(f"a response ended with status {response.get('status')!r}")
    try:
        messages = chat_messages(exchange.request)
        tools = chat_tools(exchange.request.get("tools"))
        choice = Choice.model_validate(choice_from_response(response))
    except (ResponsesFormatError, ValueError) as exc:
        raise NotATurn(f"a response could not be read as a chat turn ({exc})") from None
    return ChatTurn(messages, tools or None, choice)


def _completion(exchange: CompletionsExchange) -> ChatTurn:
    first, notes = _choice0(_dump(exchange.response)["choices"], "completion")
    prompt = exchange.request.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        raise NotATurn("a completion of a batch of prompts is not one conversation")
    text = prompt if isinstance(prompt, str) else ""
    logprobs = first.get("logprobs") or {}
    ids = first.get("token_ids")
    values = logprobs.get("token_logprobs") or []
    tokens = logprobs.get("tokens") or [f"token_id:{i}" for i in ids or []]
    content: list[dict[str, Any]] | None = [
        {"token": str(token), "logprob": float(value), "bytes": None, "top_logprobs": []}
        for token, value in zip(tokens, values)
        if value is not None
    ] or None
    choice = {
        "index": 0,
        "finish_reason": first.get("finish_reason") or "stop",
        "message": {"role": "assistant", "content": first.get("text") or ""},
        "logprobs": {"content": content} if content else None,
    }
    for key in ("token_ids", "prompt_token_ids", "step"):
        if first.get(key) is not None:
            choice[key] = first[key]
    if choice.get("prompt_token_ids") is None and isinstance(prompt, list):
        choice["prompt_token_ids"] = list(prompt)
    return ChatTurn([{"role": "user", "content": text}], None, Choice.model_validate(choice), notes)


_STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "pause_turn": "stop",
    "refusal": "content_filter",
}


def anthropic_chat_messages(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An Anthropic Messages request's `system` and `messages` as chat messages: text blocks
    joined by newlines, `tool_use` blocks as the assistant's `tool_calls`, each `tool_result` a
    `tool` message. The reading `art.messages_format` does for our server, minus its refusals:
    a captured call may have gone to a server that takes more (images, a prefill)."""
    out: list[dict[str, Any]] = []
    system = request.get("system")
    if system:
        out.append({"role": "system", "content": _block_text(system)})
    for message in request.get("messages") or []:
        if not isinstance(message, Mapping):
            continue
        role, content = message.get("role"), message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        text = "\n".join(str(b.get("text", "")) for b in blocks if isinstance(b, Mapping) and b.get("type") == "text")
        calls = [_tool_call(b) for b in blocks if isinstance(b, Mapping) and b.get("type") == "tool_use"]
        results = [b for b in blocks if isinstance(b, Mapping) and b.get("type") == "tool_result"]
        for result in results:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": result.get("tool_use_id"),
                    "content": _block_text(result.get("content")),
                }
            )
        if text or calls or not results:
            chat: dict[str, Any] = {"role": role, "content": text}
            if calls:
                chat["tool_calls"] = calls
            out.append(chat)
    return out


def anthropic_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions (`name`, `description`, `input_schema`) as chat function tools."""
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object"},
            },
        }
        for t in tools
        if isinstance(t, Mapping) and "name" in t
    ]


def _block_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, Mapping) and b.get("type") == "text")


def _tool_call(block: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})},
    }


def _message(exchange: MessagesExchange) -> ChatTurn:
    message = _dump(exchange.response)
    blocks = message.get("content") or []
    text = "\n".join(b.get("text") or "" for b in blocks if b.get("type") == "text")
    calls = [_tool_call(b) for b in blocks if b.get("type") == "tool_use"]
    assistant: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        assistant["tool_calls"] = calls
    thinking = "".join(b.get("thinking") or "" for b in blocks if b.get("type") == "thinking")
    if thinking:
        assistant["reasoning_content"] = thinking
    choice: dict[str, Any] = {
        "index": 0,
        "message": assistant,
        "finish_reason": _STOP_REASONS.get(message.get("stop_reason") or "", "stop"),
        "logprobs": None,
    }
    ids, values = message.get("token_ids"), message.get("logprobs")
    if isinstance(values, list) and all(isinstance(v, (int, float)) for v in values):
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{i}", "logprob": float(v), "bytes": None, "top_logprobs": []}
                for i, v in zip(ids or [], values)
            ]
        }
    for key in ("token_ids", "prompt_token_ids", "step"):
        if message.get(key) is not None:
            choice[key] = message[key]
    messages = anthropic_chat_messages(exchange.request)
    return ChatTurn(messages, anthropic_chat_tools(exchange.request.get("tools")), Choice.model_validate(choice))
