"""Tool calling for chat templates that know tools and for those that do not.

A request's `tools` reach the model in one of two ways. A chat template that supports tools
(its source mentions `tools`, as Qwen's and Hermes' do) gets the messages unchanged and renders
the schemas itself. Any other template (SmolLM2's renders `<|im_start|>{role}\\n{content}` for
every role and ignores tools) gets the Hermes convention spelled out in plain text: a preamble
with the schemas inside `<tools></tools>` at the head of the system message, earlier tool calls
as `<tool_call>` JSON blocks in the assistant's content, and tool results as
`<tool_response>` blocks. Either way the model answers in text, and `parse_tool_calls` turns its
`<tool_call>` blocks into OpenAI's `message.tool_calls`.

This module only rewrites messages and parses text. It never touches token ids: the sampled ids
and logprobs of a completion are returned for training exactly as sampled, whatever was parsed
out of its text.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)


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


# -- prompt --------------------------------------------------------------------------------


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
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
             {"role": "tool", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # noqa: BLE001 - any template error means the role is unknown
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


# -- completion ----------------------------------------------------------------------------


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a completion into its content and OpenAI tool calls. Never raises.

    Every `<tool_call>...</tool_call>` block whose body is a JSON object (whitespace and a
    ```json fence around it are tolerated) with a string `name` and `arguments` given as an
    object or a JSON string of one (absent means `{}`) becomes
    `{"id": "call_<hex>", "type": "function", "function": {"name", "arguments": <JSON string>}}`.
    The last block may lack `</tool_call>` (cut by EOS, a stop string or max_tokens) if its
    JSON is complete. Blocks that do not parse stay in the content, which is the text outside
    parsed blocks, stripped, or None when nothing is left.
    """
    try:
        return _parse(text)
    except Exception:  # noqa: BLE001 - a parsing bug must not lose the completion
        log.exception("tool call parsing failed; the completion is returned as content")
        return (text.strip() or None) if isinstance(text, str) else None, []


def _parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    kept: list[str] = []
    calls: list[dict[str, Any]] = []
    pos = 0
    while (start := text.find(OPEN, pos)) != -1:
        body_start = start + len(OPEN)
        close = text.find(CLOSE, body_start)
        reopen = text.find(OPEN, body_start)
        if close != -1 and (reopen == -1 or close < reopen):
            body, end = text[body_start:close], close + len(CLOSE)
        elif reopen == -1:  # the final block, cut off before its closing tag
            body, end = text[body_start:], len(text)
        else:  # an unclosed block followed by another one: malformed, stays content
            kept.append(text[pos:reopen])
            pos = reopen
            continue
        call = _call(body)
        if call is None:
            kept.append(text[pos:end])
        else:
            kept.append(text[pos:start])
            calls.append(call)
        pos = end
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return content or None, calls


def _call(body: str) -> dict[str, Any] | None:
    body = body.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = obj.get("arguments", {})
    if not isinstance(name, str) or not name.strip():
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def split_completion(text: str, active: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a completion: `(text, [])` unless tools are active and it parses."""
    if not active:
        return text, []
    content, calls = parse_tool_calls(text)
    return (content, calls) if calls else (text, [])


def stream_deltas(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stream deltas of a choice with tool calls: its content once, then each call whole
    (OpenAI's `delta.tool_calls` shape: index, id, type, function name and arguments).
    Empty without calls: such a choice streams its text token by token instead."""
    if not calls:
        return []
    deltas: list[dict[str, Any]] = [{"content": content}] if content else []
    deltas += [{"tool_calls": [{"index": j, **call}]} for j, call in enumerate(calls)]
    return deltas
