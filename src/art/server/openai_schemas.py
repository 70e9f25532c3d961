"""The bodies of the OpenAI-compatible routes: the chat-completions request, with OpenAI's field
names and limits (its sampling fields shared with the legacy completions request), and the
Responses and Anthropic Messages requests served through it (`art.server.app`).

Validation lives here so a bad request fails before it touches the engine, with a 400 that
names the field (the app maps pydantic's errors). Fields we accept but cannot honour
(penalties) are rejected unless neutral, rather than silently ignored: a user who asks for a
penalty must not get samples that quietly lack it. Unknown extra fields are ignored, as
OpenAI-compatible servers do, so clients sending newer fields keep working. Responses are
built as plain dicts (`art.server.openai_format`); the official client parses them. The
management routes' bodies are `art.server.management_schemas`'.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from art.chat_template import ChatMessage
from art.errors import ArtValueError
from art.naming import echo
from art.numeric import is_int

# -- chat completions ------------------------------------------------------------------------


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


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (`extra_body`): exactly one of its constraints. Its options
    (`disable_any_whitespace`, ...) are ignored: JSON is always generated compact."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    """True: any JSON object (the same as `{"json": {"type": "object"}}`)."""

    @field_validator("json_")
    @classmethod
    def _json_object(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return _schema_object(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if (
            sum(
                value is not None
                for value in (self.json_, self.regex, self.choice, self.grammar, self.json_object or None)
            )
            != 1
        ):
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self

    def constraint(self) -> tuple[str, Any, str]:
        """(kind, value, its field name) of the one constraint given."""
        if self.json_object:
            return "json", {"type": "object"}, "json_object"
        return next(
            (kind, value, kind)
            for kind, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        )


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older names of the same constraints, each a request field of its own."""


TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""`apply_chat_template`'s own arguments: a request's template variables may not name them."""


class SamplingFields(BaseModel):
    """The sampling fields chat completions and legacy completions share (OpenAI's names and
    ranges, vLLM's extensions), with their checks."""

    model_config = ConfigDict(extra="ignore")

    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    """vLLM extension (`extra_body`): draw only from the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """vLLM extension: drop tokens less likely than min_p times the most likely one; 0 keeps all."""
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM extension: keep sampling past end-of-sequence (benchmarks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    """vLLM extension; only the neutral 1 is accepted, like the penalties above."""

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

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty_unsupported(cls, value: float | None) -> float | None:
        if value is not None and value != 1:
            raise ValueError("unsupported: only 1 is accepted (the sampler applies no penalties)")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions body (OpenAI's names and ranges)."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of `max_completion_tokens`; None: fill the context."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """Wins over `max_tokens` when both are given."""
    logprobs: bool = False
    """Only decides `top_logprobs`; the sampled tokens' logprobs are always returned."""
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    """Functions the model may call: [{"type": "function", "function": {"name", "description",
    "parameters"}}]. Rendered by the chat template, or as a Hermes `<tool_call>` preamble in the
    system message when the template knows no tools (`art.chat_template`)."""
    tool_choice: str | dict[str, Any] | None = None
    """One of "auto" (None means the same), "none" (tools left out of the prompt, nothing
    parsed), "required" or {"type": "function", "function": {"name": ...}}. The last two are
    enforced by constrained decoding: the completion is one or more tool calls."""
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    """{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}:
    completions are constrained to that JSON by the engine (`art.server.structured_output`)."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM extension: completions are JSON that this schema accepts (like `response_format`)."""
    guided_regex: str | None = Field(None, min_length=1)
    """vLLM extension: completions match this regular expression."""
    guided_choice: list[str] | None = Field(None, min_length=1)
    """vLLM extension: each completion is exactly one of these strings."""
    guided_grammar: str | None = Field(None, min_length=1)
    """vLLM extension: completions follow this grammar, in llguidance's Lark syntax."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's newer form of the four above: {"json" | "regex" | "choice" | "grammar": ...}."""
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the model's chat template (vLLM's field; ART sends it), such as
    `{"enable_thinking": false}`: they change the prompt, whose ids every choice reports."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if len(value) > 32:
            raise ValueError("at most 32 chat_template_kwargs are accepted")
        taken = sorted(set(value) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do")
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
            elif isinstance(function, dict) and not isinstance(function.get("parameters", {}), dict):
                problems.append(f"tools[{i}].function.parameters must be a JSON schema object")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any, info: ValidationInfo) -> Any:
        named = (
            isinstance(value, dict)
            and value.get("type") == "function"
            and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)
        )
        if value is not None and value not in ("none", "auto", "required") and not named:
            raise ValueError(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
            )
        if "tools" not in info.data:  # tools itself was invalid; that error is reported
            return value
        names = [t["function"]["name"] for t in info.data["tools"] or []]
        if (value == "required" or named) and not names:
            raise ValueError(f"tool_choice {echo(value)} requires tools")
        if named and value["function"]["name"] not in names:
            raise ValueError(
                f"tool_choice names {echo(value['function']['name'])}, which is not among the tools {names}"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # A field validator (not a model one) so the error names `top_logprobs`.
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs=true")
        return value

    @field_validator("guided_json")
    @classmethod
    def _guided_json_object(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return _schema_object(value)

    def vllm_constraint(self) -> tuple[str, Any, str] | None:
        """(kind, value, field) of the vLLM constraint asked for (kind: json, regex, choice or
        grammar), None when there is none. One beside another constraint on the completion (a
        second one, a `response_format` other than text, a forced tool choice) is an
        ArtValueError. (OpenAI's own two may come together: the forced call wins.)"""
        given = [
            (name.removeprefix("guided_"), getattr(self, name), name)
            for name in GUIDED_FIELDS
            if getattr(self, name) is not None
        ]
        if self.structured_outputs is not None:
            kind, value, name = self.structured_outputs.constraint()
            given.append((kind, value, f"structured_outputs.{name}"))
        others = [
            name
            for name, on in (
                ("response_format", self.response_format is not None and self.response_format.type != "text"),
                ("tool_choice", self.tool_choice == "required" or isinstance(self.tool_choice, dict)),
            )
            if on
        ]
        if given and len(given) + len(others) > 1:
            names = others + [field for _, _, field in given]
            raise ArtValueError(
                f"{' and '.join(names)} each constrain the completion: give one of them", field=names[-1]
            )
        return given[0] if given else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _schema_object(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"a JSON schema given as a string must be JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("a JSON schema must be an object")
    return parsed


class ResponsesRequest(BaseModel):
    """POST /v1/responses body: the part of OpenAI's Responses API that agent libraries (the
    OpenAI Agents SDK) send. It is served as the chat request it means (`art.responses_format`),
    which reads and names the items of `input`, the tools and `text.format`; here are the
    scalar fields and what cannot be served. Settings that change nothing here (`store`,
    `include` other than output-text logprobs, `reasoning`, `truncation`, `service_tier`) are
    accepted and ignored; state kept between calls (`previous_response_id`, `conversation`,
    stored `prompt`s, `background`) is refused with a 400 naming the field."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: Any
    """A string (one user message) or a list of items."""
    instructions: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """0 means greedy."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    text: dict[str, Any] | None = None
    """`{"format": {"type": "text" | "json_object" | "json_schema", ...}}`, enforced as chat's
    `response_format` is."""
    stream: bool = False
    store: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    seed: int | None = None
    """Our extension (as on chat): a seeded request samples the same tokens again."""
    stop: str | list[str] | None = None
    """Our extension, as chat's `stop`."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Our extension, as chat's."""

    @field_validator("input", "instructions")
    @classmethod
    def _text_or_items(cls, value: Any, info: ValidationInfo) -> Any:
        # One clear message instead of pydantic's per-union-member errors; the items are read later.
        if not isinstance(value, (str, list)) and not (value is None and info.field_name == "instructions"):
            raise ValueError("must be a string or a list of items")
        return value

    @field_validator("previous_response_id", "conversation", "prompt")
    @classmethod
    def _no_stored_state(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(
                f"unsupported: this server stores no responses, conversations or prompts; send the "
                f"whole conversation as input items instead of {info.field_name}"
            )
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("unsupported: responses are answered in the request (or streamed), not in the background")
        return value


MAX_PROMPTS = 64
"""Prompts in one legacy completions request (its batch form)."""
MAX_CHOICES = 128
"""Choices in one legacy completions request: prompts times n (chat's bound on n)."""

REFUSED_ON_COMPLETIONS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
"""Constraints chat completions honour and /v1/completions does not: refused rather than ignored."""


class CompletionRequest(SamplingFields):
    """POST /v1/completions body: OpenAI's legacy Completions, with vLLM's extensions. Served by
    `art.server.completions_format`, which tokenizes the prompt and checks its ids against the
    vocabulary. What it cannot honour is refused: `suffix`, `best_of` other than `n`, a
    `logit_bias`, `echo` with `logprobs` (prompt logprobs are not computed), structured outputs."""

    model: str
    prompt: Any
    """A string, a list of token ids, or a batch: a list of strings or of token id lists."""
    max_tokens: int | None = Field(16, ge=1)
    """OpenAI's default is 16; None fills the context (up to the server's default)."""
    logprobs: int | None = Field(None, ge=0, le=20)
    """Alternatives per position in `top_logprobs`. The sampled tokens' logprobs are always
    returned (for training); None leaves `top_logprobs` null."""
    echo: bool = False
    """The prompt's text is put before each completion's text."""
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    return_tokens_as_token_ids: bool = False
    """vLLM extension: `logprobs.tokens` are written as "token_id:<id>" (exact for training)."""
    add_special_tokens: bool = True
    """vLLM extension: a string prompt is tokenized with the tokenizer's special tokens (a BOS)."""
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any, info: ValidationInfo) -> Any:
        def ids(item: Any) -> bool:
            return isinstance(item, list) and bool(item) and all(is_int(t) and t >= 0 for t in item)

        if isinstance(value, str) or ids(value):
            return value
        if isinstance(value, list) and value and (all(isinstance(p, str) for p in value) or all(map(ids, value))):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts are accepted in one request")
            if len(value) * info.data.get("n", 1) > MAX_CHOICES:
                raise ValueError(f"prompts times n may be at most {MAX_CHOICES} choices in one request")
            return value
        raise ValueError(
            "must be a string, a non-empty list of token ids (integers >= 0), or a non-empty list of either (a batch)"
        )

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("unsupported: this server does not insert text (suffix); leave it out")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("unsupported: best_of must equal n (every sample is returned, none is ranked)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("unsupported: the sampler applies no logit bias")
        return value

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise ValueError(
                "unsupported with logprobs: echo's logprobs cover the prompt, whose logprobs this "
                "server does not compute; leave out logprobs (token ids are still returned)"
            )
        return value

    @field_validator(*REFUSED_ON_COMPLETIONS)
    @classmethod
    def _no_constraints(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(
                f"unsupported on /v1/completions: {info.field_name} is honoured on /v1/chat/completions only"
            )
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a batch (one for a single prompt)."""
        single = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if single else list(self.prompt)


class MessagesRequest(BaseModel):
    """POST /v1/messages body: Anthropic's Messages API (what the `anthropic` SDK sends). It is
    served as the chat request it means (`art.messages_format` reads the messages, the
    system prompt and the tools); here are the scalar fields and what cannot be served.
    Settings that change nothing here (`metadata`, `service_tier`, `cache_control`, `speed`, ...)
    are ignored; extended `thinking`,
    `container` and `mcp_servers` are refused with a 400 naming the field."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int = Field(ge=1)
    """Required, as Anthropic requires it."""
    messages: list[Any] = Field(min_length=1)
    system: Any = None
    """A string or a list of text blocks."""
    stop_sequences: list[str] | None = Field(None, max_length=4)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """Anthropic's range is 0 to 1; this server samples up to 2. 0 means greedy."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    """0 keeps all tokens."""
    tools: list[Any] | None = None
    tool_choice: Any = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: dict[str, Any] | None = None
    """`{"format": {"type": "json_schema", "schema": {...}}}`: the text is constrained to JSON that the
    schema accepts (as chat's `response_format`); `effort` changes nothing here."""
    thinking: Any = None
    container: Any = None
    mcp_servers: Any = None
    seed: int | None = None
    """Our extension (as on chat): a seeded request samples the same tokens again."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Our extension, as chat's."""

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: Any) -> Any:
        if value is not None and not (isinstance(value, dict) and value.get("type") == "disabled"):
            raise ValueError("unsupported: extended thinking is not served; leave thinking out")
        return value

    @field_validator("container", "mcp_servers")
    @classmethod
    def _no_hosted(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"unsupported: {info.field_name} runs on Anthropic's side")
        return value


class MessagesCountRequest(MessagesRequest):
    """POST /v1/messages/count_tokens body: a Messages request without `max_tokens`."""

    max_tokens: int = Field(1, ge=1)
    """Not part of a count; any value renders the same prompt."""
