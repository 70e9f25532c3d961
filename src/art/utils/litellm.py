"""ART's `art.utils.litellm`: a LiteLLM `Choices` as the `openai` `Choice` a `Trajectory` holds.

LiteLLM is not a dependency: any object shaped like its choice (pydantic, or a dict) converts.
Fields the `openai` type does not name (a server's `token_ids`, `prompt_token_ids`) are kept as
extras, so a choice from our server keeps the exact ids it trains on.
"""

from __future__ import annotations

from typing import Any

from openai.types.chat.chat_completion import Choice

from art.errors import ArtValueError


def _as_dict(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, dict):
        return {k: _as_dict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dict(v) for v in value]
    return value


def convert_litellm_choice_to_openai(litellm_choice: Any) -> Choice:
    """The assistant choice (message, tool calls, logprobs) as an `openai` `Choice`."""
    data = _as_dict(litellm_choice)
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, dict) or message.get("role") != "assistant":
        raise ArtValueError(
            "convert_litellm_choice_to_openai takes an assistant choice (message.role "
            f"'assistant'), got {type(litellm_choice).__name__}",
            field="litellm_choice",
        )
    for call in message.get("tool_calls") or []:
        if call.get("type", "function") != "function" or not (call.get("function") or {}).get("name"):
            raise ArtValueError("only function tool calls with a name convert", field="litellm_choice.tool_calls")
        call["type"] = "function"
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)
    logprobs = data.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("content") is None:
        data["logprobs"] = None
    data["finish_reason"] = data.get("finish_reason") or "stop"
    data["index"] = data.get("index") or 0
    return Choice.model_validate(data)
