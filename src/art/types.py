"""Public typing aliases and the user-facing training config (ART's names)."""

from __future__ import annotations

from typing import Union

from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_param import ChatCompletionMessageParam
from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam
from pydantic import BaseModel, ConfigDict, Field

Message = ChatCompletionMessageParam
MessageOrChoice = Union[ChatCompletionMessageParam, Choice]
Messages = list[ChatCompletionMessageParam]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[ChatCompletionToolParam]


class TrainConfig(BaseModel):
    """The knobs most users touch. Advanced options live in `art.dev.TrainConfig`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    learning_rate: float = Field(5e-6, gt=0, description="AdamW learning rate (constant).")
    beta: float = Field(0.0, ge=0, description="KL penalty coefficient against the base model; 0 disables it.")
