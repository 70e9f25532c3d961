"""gpt-oss replies in OpenAI's harmony format: messages on channels, split here into an answer.

A reply is one or more messages, each `<|start|>{role}{header}<|message|>{body}{end}` (the
generation prompt already opened the first with `<|start|>assistant`). The header names the
channel (`<|channel|>analysis`, `commentary` or `final`) and for a tool call its recipient
(` to=functions.get_weather`, before or after the channel), maybe a `<|constrain|>json`; the end
is `<|end|>`, `<|return|>` (the last message) or `<|call|>` (a tool call). The analysis channel is
the model's reasoning, the final channel its answer, and a message to `functions.NAME` a tool
call whose body is the arguments. Decoded without special tokens, as other replies are, all of it
runs together ("analysisThe user asks...assistantfinalParis"), so a tokenizer that has these
tokens gets its replies parsed here; the sampled ids are untouched either way, so training sees
exactly what was sampled.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

START, END, MESSAGE, CHANNEL, RETURN, CALL, CONSTRAIN = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
)
SPECIAL = (START, END, MESSAGE, CHANNEL, RETURN, CALL)
_ENDS = re.compile(re.escape(END) + "|" + re.escape(RETURN) + "|" + re.escape(CALL))
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Reply:
    """A harmony reply as an OpenAI chat message: reasoning, content and tool calls."""

    reasoning: str | None = None
    content: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)


def speaks_harmony(tokenizer) -> bool:
    """Whether the tokenizer has harmony's special tokens as single tokens (gpt-oss's has)."""
    vocab = tokenizer.get_vocab()
    return all(token in vocab for token in SPECIAL)


def parse(text: str) -> Reply:
    """The reply `text` (decoded with its special tokens) by channel. A message cut short (the
    length limit) counts as far as it got; text outside any message is content. Never raises."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for message in text.split(START):
        if not message:
            continue
        head, found, body = message.partition(MESSAGE)
        if not found:  # no header: plain text (or a header cut short)
            if CHANNEL not in head:
                content.append(head)
            continue
        body = _ENDS.split(body, maxsplit=1)[0]
        channel = head.split(CHANNEL, 1)[1] if CHANNEL in head else ""
        channel = channel.split(CONSTRAIN, 1)[0]
        recipient = _RECIPIENT.search(head)
        channel_name = _RECIPIENT.sub("", channel).split()[0] if channel.split() else ""
        if recipient and recipient.group(1).startswith("functions."):
            calls.append(_call(recipient.group(1).removeprefix("functions."), body.strip()))
        elif channel_name == "analysis":
            reasoning.append(body)
        else:  # final, or commentary addressed to the user
            content.append(body)
    return Reply(_joined(reasoning), _joined(content), calls)


def _joined(parts: list[str]) -> str | None:
    text = "".join(parts).strip()
    return text or None


def _call(name: str, arguments: str) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}
