"""Public typing aliases and the user-facing training config (ART's names)."""

from __future__ import annotations

from typing import Any, Literal

from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_param import ChatCompletionMessageParam
from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam
from pydantic import BaseModel, ConfigDict, Field

Message = ChatCompletionMessageParam
MessageOrChoice = ChatCompletionMessageParam | Choice
Messages = list[ChatCompletionMessageParam]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[ChatCompletionToolParam]


def as_dict(value: Any, **dump: Any) -> dict[str, Any]:
    """A pydantic object's `model_dump(**dump)` (an SDK type, a config), else `dict(value)` (a
    mapping already); None is {}."""
    if value is None:
        return {}
    return value.model_dump(**dump) if hasattr(value, "model_dump") else dict(value)


class TrainConfig(BaseModel):
    """The knobs most users touch. Advanced options live in `art.dev.TrainConfig`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    learning_rate: float = Field(5e-6, gt=0, description="AdamW learning rate (constant).")
    beta: float = Field(0.0, ge=0, description="KL penalty coefficient against the base model; 0 disables it.")


class TrainSFTConfig(BaseModel):
    """Options of one `model.train_sft` call (ART's names). Advanced ones live in
    `art.dev.TrainSFTConfig`; `art.training.sft_options` holds every default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    learning_rate: float | list[float] = Field(
        5e-5, description="AdamW learning rate: one value, or one per batch (a schedule; see art.utils.sft)."
    )
    batch_size: int | Literal["auto"] = Field(
        "auto", description="Trajectories per optimizer step; 'auto' is 2 (ART's LocalBackend)."
    )
    assistant_turns: Literal["all", "last"] = Field(
        "all", description="Train every assistant message, or only the last one of each conversation."
    )
