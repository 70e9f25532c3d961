"""The chat-completions request, with OpenAI's field names and limits.

Validation lives here so a bad request fails before it touches the engine, with a 400 that
names the field (the app maps pydantic's errors). Fields we accept but cannot honour
(penalties) are rejected unless neutral, rather than silently ignored: a user who asks for a
penalty must not get samples that quietly lack it. Unknown extra fields are ignored, as
OpenAI-compatible servers do, so clients sending newer fields keep working.
Responses are built as plain dicts in `app.py`; the official client parses them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from art.naming import echo


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
                raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {echo(kind)}")
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """Send a last chunk with token usage (and `choices: []`) before `[DONE]`."""


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's structured-output schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """Accepted for OpenAI's sake; every schema is enforced by constrained decoding."""


class ResponseFormat(BaseModel):
    """`response_format`: free text, any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {'name': ..., 'schema': {...}}")
        return self

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            out["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_}
        return out


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions body (OpenAI's names and ranges)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of `max_completion_tokens`; None: fill the context."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """Wins over `max_tokens` when both are given."""
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM extension: keep sampling past end-of-sequence (benchmarks)
    logprobs: bool = False
    """Only decides `top_logprobs`; the sampled tokens' logprobs are always returned."""
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    """Functions the model may call: [{"type": "function", "function": {"name", "description",
    "parameters"}}]. Rendered by the chat template, or as a Hermes `<tool_call>` preamble in the
    system message when the template knows no tools (`art.server.tools`)."""
    tool_choice: str | dict[str, Any] | None = None
    """One of "auto" (None means the same), "none" (tools left out of the prompt, nothing
    parsed), "required" or {"type": "function", "function": {"name": ...}}. The last two are
    enforced by constrained decoding: the completion is one or more tool calls."""
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    """{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}:
    completions are constrained to that JSON by the engine (`art.server.structured_output`)."""
    user: str | None = None
    metadata: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty_unsupported(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("unsupported: only 0 is accepted (the sampler applies no penalties)")
        return value

    @field_validator("tools")
    @classmethod
    def _tools_shape(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        problems = []
        for i, tool in enumerate(value or []):
            function = tool.get("function")
            if tool.get("type") != "function":
                problems.append(f"tools[{i}].type must be 'function'")
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                problems.append(f"tools[{i}].function must be an object with a non-empty string name")
            elif not isinstance(function.get("parameters", {}), dict):
                problems.append(f"tools[{i}].function.parameters must be a JSON schema object")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any, info: ValidationInfo) -> Any:
        named = (
            isinstance(value, dict) and value.get("type") == "function"
            and isinstance(value.get("function"), dict) and isinstance(value["function"].get("name"), str)
        )
        if value is not None and value not in ("none", "auto", "required") and not named:
            raise ValueError(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}"
            )
        if "tools" not in info.data:  # tools itself was invalid; that error is reported
            return value
        names = [t["function"]["name"] for t in info.data["tools"] or []]
        if (value == "required" or named) and not names:
            raise ValueError(f"tool_choice {echo(value)} requires tools")
        if named and value["function"]["name"] not in names:
            raise ValueError(f"tool_choice names {echo(value['function']['name'])}, which is not among the tools {names}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # A field validator (not a model one) so the error names `top_logprobs`.
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs=true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)
