"""OpenAI's Responses API stream events, built chunk by chunk from a chat completion stream.

This is the streaming half of `art.responses_format`, apart because it is the one stateful part
of the translation: `ResponseEvents` holds the open message item, the tool calls merged so far,
the sequence number and the ids that every event of one Response repeats, while
`art.responses_format` is pure functions of a request or a whole completion. Its closing events
carry the very `Response` that `response_object` writes for the same completion, so a streamed
and an unstreamed request answer alike. `sse` writes one event on the wire; Anthropic's
Messages stream (`art.messages_format.MessageEvents`) is written by it too.
Nothing here knows HTTP, models or torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from .responses_format import LOGPROBS_INCLUDE, new_id, response_head, response_object


class ResponseEvents:
    """A chat completion stream's chunks (dicts, choice 0) in, Responses stream events out.

    `response.created` and `response.in_progress` come with the first chunk; text deltas
    become `response.output_text.delta` events inside one message item (opened by the first
    non-empty delta); tool calls, which a chat stream sends whole at its end, become
    function_call items with one arguments delta each. `finish()` closes the open items and
    ends with `response.completed` (or `response.incomplete`) carrying the whole Response, the
    one `response_object` writes for the same completion, training fields included.
    """

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body
        self.include_logprobs = LOGPROBS_INCLUDE in (body.get("include") or [])
        self.response_id, self.message_id = new_id("resp"), new_id("msg")
        self.sequence = 0
        self.head: dict[str, Any] | None = None
        self.text = ""
        self.message_open = False
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self.unsent_logprobs: list[dict[str, Any]] = []
        self.prompt: list[int] | None = None
        self.calls: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.chunk_head: dict[str, Any] = {}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk releases."""
        events = []
        if self.head is None:
            self.chunk_head = {k: chunk.get(k) for k in ("id", "created", "model", "step", "replica")}
            self.head = response_head(
                self.body,
                self.response_id,
                chunk.get("created") or time.time(),
                chunk.get("model") or self.body.get("model") or "",
            )
            events += [
                self.event("response.created", response=self.head),
                self.event("response.in_progress", response=self.head),
            ]
        self.prompt = chunk.get("prompt_token_ids", self.prompt)
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for part in chunk.get("choices") or []:
            if part.get("index", 0) != 0:
                continue
            self.token_ids += part.get("token_ids") or []
            entries = (part.get("logprobs") or {}).get("content") or []
            self.logprobs += entries
            self.unsent_logprobs += entries
            delta = part.get("delta") or {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                events += self._open_message()
                self.text += delta["content"]
                sent, self.unsent_logprobs = self.unsent_logprobs, []
                events.append(
                    self.event(
                        "response.output_text.delta",
                        item_id=self.message_id,
                        output_index=0,
                        content_index=0,
                        delta=delta["content"],
                        logprobs=sent if self.include_logprobs else [],
                    )
                )
            for call in delta.get("tool_calls") or []:
                self._merge_call(call)
            if part.get("finish_reason") is not None:
                self.finish_reason = part["finish_reason"]
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message_open:
            return []
        self.message_open = True
        item = {"id": self.message_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=0, item=item),
            self.event(
                "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0, part=part
            ),
        ]

    def _merge_call(self, delta: Mapping[str, Any]) -> None:
        index = delta.get("index", len(self.calls))
        while len(self.calls) <= index:
            self.calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call, function = self.calls[index], delta.get("function") or {}
        call["id"] = call["id"] or delta.get("id")
        if function.get("name"):
            call["function"]["name"] = function["name"]
        if isinstance(function.get("arguments"), str):
            call["function"]["arguments"] += function["arguments"]

    def completion(self) -> dict[str, Any]:
        """What the stream carried, as the chat completion dict the same request returns whole."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text if (self.text or not self.calls) else None}
        if self.calls:
            message["tool_calls"] = self.calls
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": self.finish_reason or "stop",
            "logprobs": {"content": self.logprobs},
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt or [],
        }
        if self.chunk_head.get("step") is not None:
            choice["step"] = self.chunk_head["step"]
        return {
            **{k: v for k, v in self.chunk_head.items() if v is not None},
            "object": "chat.completion",
            "choices": [choice],
            "usage": self.usage,
            "prompt_token_ids": self.prompt or [],
        }

    def finish(self) -> list[dict[str, Any]]:
        """The closing events, after the chat stream's last chunk."""
        completion = self.completion()
        call_ids = [new_id("fc") for _ in self.calls]
        response = response_object(
            completion, self.body, response_id=self.response_id, message_id=self.message_id, call_ids=call_ids
        )
        events = []
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                events += self._open_message()
                part = item["content"][0]
                events += [
                    self.event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=part["logprobs"],
                    ),
                    self.event(
                        "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                    ),
                    self.event("response.output_item.done", output_index=index, item=item),
                ]
            else:
                events += [
                    self.event(
                        "response.output_item.added",
                        output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"},
                    ),
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=item["arguments"],
                    ),
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    ),
                    self.event("response.output_item.done", output_index=index, item=item),
                ]
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self.event(kind, response=response))
        return events

    def failed(self, message: str, code: str = "server_error") -> list[dict[str, Any]]:
        """The events that end a stream whose sampling failed after it started."""
        head = self.head or response_head(self.body, self.response_id, time.time(), self.body.get("model") or "")
        return [
            self.event(
                "response.failed", response={**head, "status": "failed", "error": {"code": code, "message": message}}
            )
        ]


def sse(event: Mapping[str, Any]) -> str:
    """One stream event as a server-sent event, named by its type (as OpenAI and Anthropic send them)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
