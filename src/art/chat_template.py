"""How a conversation becomes token ids: the one rendering that serving, SFT and the probe share.

The OpenAI routes render a request's messages into the prompt the engine samples after, and SFT
renders a conversation into the ids it trains (`art.training.chat_tokens`); what SFT teaches is
exactly what serving later shows only because both go through here: the same message
normalisation (`ChatMessage.for_template`), the same tool handling, the same template call
(`prompt_ids`).

A request's `tools` reach the model in one of two ways. A chat template that supports tools
(its source mentions `tools`, as Qwen's and Hermes' do) gets the messages unchanged and renders
the schemas itself. Any other template (SmolLM2's renders `<|im_start|>{role}\\n{content}` for
every role and ignores tools) gets the Hermes convention spelled out in plain text: a preamble
with the schemas inside `<tools></tools>` at the head of the system message, earlier tool calls
as `<tool_call>` JSON blocks in the assistant's content, and tool results as
`<tool_response>` blocks. Either way the model answers in text, and
`art.server.openai_format.parse_tool_calls` turns its `<tool_call>` blocks into OpenAI's
`message.tool_calls`.

This module knows nothing of HTTP, sampling or training: it validates messages, rewrites them
and calls the template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from art.errors import ArtValueError
from art.naming import echo

OPEN, CLOSE = "<tool_call>", "</tool_call>"
"""The Hermes tags around a tool call, in the preamble and in the completions parsed back."""


# -- messages ------------------------------------------------------------------------------


class TextPart(BaseModel):
    """A text content part; other part types (images, audio) are not supported."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of the conversation. Extra keys (e.g. `reasoning_content`) pass through."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        # One clear message instead of pydantic's per-union-member errors.
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string, a list of text parts, or null")
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {echo(kind)}"
                )
        return value

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_shape(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments": "<json>"}};
        # arguments may also be a mapping (some clients send one).
        problems = []
        for i, call in enumerate(value or []):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                problems.append(f"tool_calls[{i}].function must be an object with a string name")
            elif not isinstance(function.get("arguments", ""), (str, dict)):
                problems.append(f"tool_calls[{i}].function.arguments must be a JSON string")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # OpenAI: content may be omitted only by an assistant message that calls tools.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required unless an assistant message has tool_calls")
        return self

    def for_template(self) -> dict[str, Any]:
        """The dict a Hugging Face chat template expects: content as one string.

        Text parts are joined with newlines (vLLM's convention); tool-call arguments are
        parsed from JSON because many templates render them as a mapping (vLLM does the same).
        """
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        elif self.content is None:
            out["content"] = ""
        if self.tool_calls:
            out["tool_calls"] = [_parse_arguments(call) for call in self.tool_calls]
        return out


def _parse_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# -- tools --------------------------------------------------------------------------------


def tools_active(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> bool:
    """Whether the prompt offers the tools and completions are parsed for calls.

    `tool_choice` (validated by the request schema):
    - absent or "auto": offer the tools; the model decides whether to call one.
    - "none": the tools are left out of the prompt and completions are not parsed.
    - "required" or {"type": "function", "function": {"name": ...}}: offered the same way, and
      enforced by constrained decoding (`art.server.structured_output`): the completion is one
      or more `<tool_call>` blocks of the allowed functions, with arguments that fit their
      schemas.
    """
    return bool(tools) and tool_choice != "none"


@dataclass(frozen=True)
class TemplateInfo:
    supports_tools: bool
    """The template renders `tools` itself (its source mentions them)."""
    tool_role: str
    """Role that carries tool results when we render them: "tool" when the template renders
    that role, else "user" (templates that know only system/user/assistant)."""


_TEMPLATES: dict[str, TemplateInfo] = {}
_PROBE = "art-probe-7f3a"


def template_info(tokenizer) -> TemplateInfo:
    """What the tokenizer's chat template can do with tools (cached per template source)."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):  # named templates (older transformers)
        source = "\n".join(str(s) for s in source.values())
    source = source or ""
    if source not in _TEMPLATES:
        _TEMPLATES[source] = TemplateInfo("tools" in source, _tool_role(tokenizer))
    return _TEMPLATES[source]


def _tool_role(tokenizer) -> str:
    """Render a `tool` message once: if the template raises or drops it, results go as `user`."""
    probe = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": _PROBE},
    ]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # any template error means the role is unknown
        return "user"
    return "tool" if isinstance(text, str) and _PROBE in text else "user"


def template_messages(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools` argument to hand to `apply_chat_template`.

    `messages` are template dicts (`ChatMessage.for_template()`). With a tool-aware template
    they pass unchanged; otherwise earlier tool calls and results are written out as Hermes
    text (whether or not this request offers tools, so a conversation renders the same way
    from turn to turn) and, when tools are active, the preamble joins the system message.
    """
    active = tools_active(tools, tool_choice)
    info = template_info(tokenizer)
    if info.supports_tools:
        return messages, (tools if active else None)
    out = _history_as_text(messages, info.tool_role)
    if active:
        out = _with_preamble(out, tools or [])
    return out, None


def tool_preamble(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that offers `tools` in the Hermes `<tool_call>` convention."""
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You have access to functions that you may call to help with the request. Each one is "
        "described by a JSON schema inside <tools></tools>:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "To call a function, reply with a <tool_call></tool_call> block holding a JSON object "
        "with the function's name and its arguments (one block per call):\n"
        f'{OPEN}\n{{"name": "<function name>", "arguments": {{"<argument>": <value>}}}}\n{CLOSE}\n'
        "Use only the functions listed above, with arguments that match their schemas. The "
        "results come back inside <tool_response></tool_response>."
    )


def _with_preamble(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    preamble = tool_preamble(tools)
    if messages and messages[0].get("role") == "system":
        first, rest = messages[0], messages[1:]
        text = first.get("content") or ""
        return [{**first, "content": f"{preamble}\n\n{text}" if text else preamble}, *rest]
    return [{"role": "system", "content": preamble}, *messages]


def call_block(call: dict[str, Any]) -> str:
    """One OpenAI tool call (arguments as a JSON string or a mapping) as a `<tool_call>` block."""
    function = call.get("function") or {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # kept as the string it is
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _history_as_text(messages: list[dict[str, Any]], tool_role: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    merge = False  # the last message is tool results sent as `user`: later ones join it
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = "\n".join(call_block(call) for call in message["tool_calls"])
            text = message.get("content") or ""
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rest, "content": f"{text}\n{blocks}" if text else blocks})
        elif role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if tool_role == "tool":
                out.append({**message, "content": response})
            elif merge:  # consecutive results in one user turn (roles must alternate in some templates)
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response})
            merge = tool_role != "tool"
            continue
        else:
            out.append(message)
        merge = False
    return out


# -- token ids -----------------------------------------------------------------------------


def prompt_ids(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool,
    where: str,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids of `apply_chat_template(messages, tools)` (`template_messages`' output) as
    a plain list. `template_kwargs` are the template's own variables (vLLM's and ART's
    `chat_template_kwargs`, e.g. `enable_thinking`). `where` names the messages in the
    ArtValueError a template's failure becomes."""
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **(template_kwargs or {})
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        # Templates are user-facing programs: whatever they raise on these messages is the
        # messages' problem (or a model without a chat template), never the server's.
        raise ArtValueError(f"the chat template rejected {where}: {type(exc).__name__}: {exc}", where) from exc
    # transformers 5 returns a BatchEncoding (a dict); older versions a plain list.
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]
