"""Anthropic's Messages API (`POST /v1/messages`, what the `anthropic` SDK calls) in terms of chat
completions, both ways, as `art.responses_format` does for OpenAI's Responses API.

The server answers a Messages request by turning it into the chat request it means
(`chat_request`), sampling that as any chat request (the chat template renders the prompt, so
the token invariant is chat's), and writing the chat completion back as an Anthropic `Message`
(`message_object`), or a chat stream's chunks as Anthropic's stream events (`MessageEvents`,
written on the wire by `art.responses_events.sse`).

How content maps:
- `system` (a string or text blocks) -> a leading system message; text blocks join with newlines.
- a user message's text blocks -> a user message; each `tool_result` block -> a `tool` message
  (`tool_use_id` as its `tool_call_id`), in the order given.
- an assistant message's text blocks -> its content, its `tool_use` blocks -> `tool_calls`
  (`input` written as JSON, as chat writes a parsed call's arguments, so a call sent back renders
  as the tokens that were sampled); `thinking` blocks are skipped (nothing here produces them).
- `tools` (`name`, `description`, `input_schema`) -> chat function tools; `tool_choice` auto /
  any / tool / none -> "auto" / "required" / the named function / "none"
  (`disable_parallel_tool_use` -> `parallel_tool_calls: false`).
- `output_config.format` (a JSON schema) -> chat's `response_format`, enforced by the engine.
- the chat choice -> content blocks: its text (when not empty), then one `tool_use` per call;
  finish "tool_calls" -> stop_reason "tool_use", "length" -> "max_tokens", a matched stop string
  (vLLM's `stop_reason`) -> "stop_sequence" with `stop_sequence`, else "end_turn".

Beside Anthropic's fields a `Message` from our server carries the training fields at its top
level, where ART's capture reads them: `token_ids` (the sampled ids), `prompt_token_ids`,
`logprobs` (a list of floats, one per sampled id) and `step`. A stream carries
`prompt_token_ids` and `step` on `message_start`'s message, and `token_ids`, `logprobs`,
`prompt_token_ids` and `step` on the `message_delta` event.

Bad input raises `MessagesFormatError`, whose `param` names the field (`messages[1].content[0].type`).
Nothing here knows HTTP, models or torch.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

CLIENT_TOOLS = ("custom", None)
"""Tool `type`s of client tools (a function the model calls); any other runs on Anthropic's side."""
FIELDS = {
    "messages": "messages",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
}
"""Chat request fields -> the Messages fields they came from (for the 400s that name them)."""


class MessagesFormatError(ValueError):
    """A Messages request that cannot be read as a chat request; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- request: Messages -> chat ----------------------------------------------------------------


def _block_text(block: Mapping[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise MessagesFormatError(f"{where}.text must be a string", f"{where}.text")
    return block["text"]


def _texts(blocks: Any, at: str) -> str:
    """A string, or text blocks joined by newlines."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise MessagesFormatError(f"{at} must be a string or a list of text blocks", at)
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind != "text":
            raise MessagesFormatError(
                f"{at}[{j}].type {_show(kind)} is not supported here: only text blocks are", f"{at}[{j}].type"
            )
        texts.append(_block_text(block, f"{at}[{j}]"))
    return "\n".join(texts)


def _user(content: Any, at: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise MessagesFormatError(f"{at} must be a string or a non-empty list of content blocks", at)
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        where = f"{at}[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(_block_text(block, where))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise MessagesFormatError(f"{where}.tool_use_id must be a non-empty string", f"{where}.tool_use_id")
            result = block.get("content", "")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _texts(result if result is not None else "", f"{where}.content"),
                }
            )
        else:
            raise MessagesFormatError(
                f"{where}.type {_show(kind)} is not supported in a user message: only text and tool_result blocks are",
                f"{where}.type",
            )
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(content: Any, at: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise MessagesFormatError(f"{at} must be a string or a list of content blocks", at)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{at}[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(_block_text(block, where))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            checks = {
                "id": isinstance(call_id, str) and call_id,
                "name": isinstance(name, str) and name,
                "input": isinstance(arguments, Mapping),
            }
            bad = next((key for key, ok in checks.items() if not ok), None)
            if bad is not None:
                what = "an object" if bad == "input" else "a non-empty string"
                raise MessagesFormatError(f"{where}.{bad} must be {what}", f"{where}.{bad}")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a model's hidden reasoning, replayed by some clients; ours produce none
        else:
            raise MessagesFormatError(
                f"{where}.type {_show(kind)} is not supported in an assistant message: only "
                "text and tool_use blocks are",
                f"{where}.type",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Messages request's `system` and `messages` stand for."""
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _texts(body["system"], "system")})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise MessagesFormatError("messages must be a non-empty list", "messages")
    for i, message in enumerate(given):
        at = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise MessagesFormatError(f"{at} must be an object with a role and content", at)
        role = message.get("role")
        if role == "user":
            out += _user(message.get("content"), f"{at}.content")
        elif role == "assistant":
            if i == len(given) - 1:
                raise MessagesFormatError(
                    f"{at}: a final assistant message (a prefill to continue) is not "
                    "supported; end with a user message",
                    f"{at}.role",
                )
            out.append(_assistant(message.get("content"), f"{at}.content"))
        else:
            raise MessagesFormatError(f"{at}.role must be 'user' or 'assistant', got {_show(role)}", f"{at}.role")
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic's client tools as chat function tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise MessagesFormatError(f"{at} must be an object", at)
        if tool.get("type") not in CLIENT_TOOLS:
            raise MessagesFormatError(
                f"{at}.type {_show(tool.get('type'))} is not supported: only client tools "
                "(name, description, input_schema) are; server tools run on Anthropic's side",
                f"{at}.type",
            )
        name, schema = tool.get("name"), tool.get("input_schema", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise MessagesFormatError(f"{at}.name must be a non-empty string", f"{at}.name")
        if not isinstance(schema, Mapping):
            raise MessagesFormatError(f"{at}.input_schema must be a JSON schema object", f"{at}.input_schema")
        if tool.get("description") is not None and not isinstance(tool["description"], str):
            raise MessagesFormatError(f"{at}.description must be a string", f"{at}.description")
        function = {"name": name, "description": tool.get("description"), "parameters": dict(schema)}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[Any, bool | None]:
    """(chat `tool_choice`, `parallel_tool_calls`) of Anthropic's `tool_choice`."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise MessagesFormatError(
            f"tool_choice must be {{'type': 'auto' | 'any' | 'tool' | 'none'}}, got {_show(choice)}", "tool_choice.type"
        )
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("any", "tool") and not tools:
        raise MessagesFormatError(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "tool":
        name = choice.get("name")
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise MessagesFormatError(
                f"tool_choice names {_show(name)}, which is not among the tools {names}", "tool_choice.name"
            )
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def chat_response_format(output_config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` as chat's `response_format` (None: free text)."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        raise MessagesFormatError(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config.format.type"
        )
    if not isinstance(fmt.get("schema"), Mapping):
        raise MessagesFormatError(
            "output_config.format.schema must be a JSON schema object", "output_config.format.schema"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": dict(fmt["schema"])}}


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions request body a Messages request means (one choice; a stream asks
    for usage, which a Message always has). Our extensions `seed` and `chat_template_kwargs` pass."""
    tools = chat_tools(body.get("tools"))
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": chat_messages(body),
        "max_tokens": body.get("max_tokens"),
    }
    if tools:
        chat["tools"] = tools
        choice, parallel = chat_tool_choice(body.get("tool_choice"), tools)
        if choice is not None:
            chat["tool_choice"] = choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    elif body.get("tool_choice") is not None:
        chat_tool_choice(body["tool_choice"], None)  # checked all the same
    response_format = chat_response_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("stop_sequences"):
        chat["stop"] = list(body["stop_sequences"])
    for key in ("temperature", "top_p", "top_k", "seed", "chat_template_kwargs"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stream"):
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat


# -- answer: chat -> Messages ------------------------------------------------------------------


def new_id(prefix: str = "msg") -> str:
    """An id in Anthropic's style (`msg_`, `toolu_` and 24 hex digits)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def stop_fields(choice: Mapping[str, Any]) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence` of a chat choice (or a stream's finish)."""
    finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(matched, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat message as content blocks: its text (when not empty), then its tool calls."""
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:  # parsed calls are JSON objects; anything else is kept whole
            arguments = {"arguments": function.get("arguments")}
        call_id = call.get("id") or new_id("toolu")
        blocks.append(
            {
                "type": "tool_use",
                "id": call_id.replace("call_", "toolu_", 1),
                "name": function.get("name", ""),
                "input": arguments,
            }
        )
    return blocks


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _training_fields(choice: Mapping[str, Any], completion: Mapping[str, Any]) -> dict[str, Any]:
    fields = {
        "token_ids": list(choice.get("token_ids") or []),
        "prompt_token_ids": list(choice.get("prompt_token_ids") or completion.get("prompt_token_ids") or []),
        "logprobs": [entry.get("logprob") for entry in (choice.get("logprobs") or {}).get("content") or []],
    }
    step = choice.get("step", completion.get("step"))
    if step is not None:
        fields["step"] = step
    if completion.get("replica") is not None:
        fields["replica"] = completion["replica"]
    return fields


def message_object(completion: Mapping[str, Any], *, message_id: str | None = None) -> dict[str, Any]:
    """A chat completion (our server's dict, choice 0) as an Anthropic `Message`, with the
    choice's training fields beside Anthropic's."""
    choice = (completion.get("choices") or [{}])[0]
    usage = completion.get("usage") or {}
    return {
        "id": message_id or new_id(),
        "type": "message",
        "role": "assistant",
        "model": completion.get("model"),
        "content": content_blocks(choice.get("message") or {}),
        **stop_fields(choice),
        "usage": _usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)),
        **_training_fields(choice, completion),
    }


# -- streams ------------------------------------------------------------------------------------


class MessageEvents:
    """A chat completion stream's chunks (dicts, choice 0) in, Anthropic stream events out.

    `message_start` comes with the first chunk; text deltas become `text_delta`s of one text
    block (opened by the first non-empty delta); tool calls, which a chat stream sends whole at
    its end, become `tool_use` blocks with one `input_json_delta` each. `finish()` closes the open
    block and ends with `message_delta` (stop reason, usage and the training fields) and
    `message_stop`.
    """

    def __init__(self) -> None:
        self.message_id = new_id()
        self.started = False
        self.block: int | None = None  # the index of the open block
        self.blocks = 0
        self.text = ""
        self.calls: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self.stop: dict[str, Any] = {}  # the finish and stop reasons of choice 0
        self.usage: dict[str, Any] = {}
        self.chunk_head: dict[str, Any] = {}

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk releases."""
        events: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            self.chunk_head = {k: chunk.get(k) for k in ("model", "step", "replica", "prompt_token_ids")}
            prompt = chunk.get("prompt_token_ids") or []
            message = {
                "id": self.message_id,
                "type": "message",
                "role": "assistant",
                "model": chunk.get("model"),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _usage(len(prompt), 0),
                "prompt_token_ids": prompt,
            }
            if chunk.get("step") is not None:
                message["step"] = chunk["step"]
            events.append({"type": "message_start", "message": message})
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for part in chunk.get("choices") or []:
            if part.get("index", 0) != 0:
                continue
            self.token_ids += part.get("token_ids") or []
            self.logprobs += (part.get("logprobs") or {}).get("content") or []
            delta = part.get("delta") or {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                if self.block is None:
                    events.append(self._open({"type": "text", "text": ""}))
                self.text += delta["content"]
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": self.block,
                        "delta": {"type": "text_delta", "text": delta["content"]},
                    }
                )
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if part.get("finish_reason") is not None:
                self.stop = {"finish_reason": part["finish_reason"], "stop_reason": part.get("stop_reason")}
        return events

    def _open(self, block: dict[str, Any]) -> dict[str, Any]:
        self.block, self.blocks = self.blocks, self.blocks + 1
        return {"type": "content_block_start", "index": self.block, "content_block": block}

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        index, self.block = self.block, None
        return [{"type": "content_block_stop", "index": index}]

    def _call(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A whole chat tool call (as our chat stream sends it) as one tool_use block."""
        [block] = content_blocks({"tool_calls": [call]})
        events = self._close()
        events.append(self._open({**block, "input": {}}))
        events.append(
            {
                "type": "content_block_delta",
                "index": self.block,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)},
            }
        )
        return events + self._close()

    def finish(self) -> list[dict[str, Any]]:
        """The closing events, after the chat stream's last chunk."""
        choice = {"token_ids": self.token_ids, "logprobs": {"content": self.logprobs}}
        training = _training_fields(choice, {k: v for k, v in self.chunk_head.items() if v is not None})
        delta = {
            "type": "message_delta",
            "delta": stop_fields(self.stop),
            "usage": {"output_tokens": int(self.usage.get("completion_tokens") or len(self.token_ids))},
            **training,
        }
        return [*self._close(), delta, {"type": "message_stop"}]

    def failed(self, message: str) -> list[dict[str, Any]]:
        """The event that ends a stream whose sampling failed after it started."""
        return [{"type": "error", "error": {"type": "api_error", "message": message}}]
