"""Agent Reinforcement Trainer: train LLM agents with GRPO on your own agent code.

The client side (this package's top level) imports no torch; `LocalBackend` loads the heavy
parts (install the `[backend]` extra) only when a trainable model is registered.
"""

from art import dev, utils
from art._retry import retry
from art.backends.local import LocalBackend
from art.backends.remote import RemoteBackend
from art.base_models import DEFAULT_MODEL
from art.capture import (
    AutoTrajectoryContext,
    auto_trajectory,
    capture_auto_trajectory,
    current_trajectory,
    current_trajectory_group,
    no_capture,
    trajectory,
    trajectory_group,
)
from art.errors import (
    ArtError,
    ArtValueError,
    BackendError,
    ContextLengthError,
    ModelNotFoundError,
    StepConflictError,
    TooManyExceptionsError,
    TrajectoryError,
)
from art.exchanges import (
    ChatCompletionsExchange,
    ChatCompletionsRequest,
    CompletionsExchange,
    CompletionsRequest,
    MessagesExchange,
    MessagesRequest,
    ResponsesExchange,
    ResponsesRequest,
    TrajectoryExchanges,
)
from art.gather import gather_trajectories, gather_trajectory_groups, trajectory_group_batches
from art.histories import (
    AnthropicMessagesHistory,
    AnthropicMessageSource,
    ChatCompletionsHistory,
    ChatCompletionsMessageSource,
    CompletionsSource,
    CompletionsStringHistory,
    CompletionsStringSourceSpan,
    CompletionsTokenHistory,
    CompletionsTokenSourceSpan,
    ResponsesHistory,
    ResponsesItemSource,
)
from art.model import Model, TrainableModel
from art.pipeline_trainer import PipelineRuntimeConfig, PipelineTrainer, make_group_rollout_fn
from art.tokenize import (
    TokenFlag,
    TokenizedHistory,
    TokenizedMultiHistoryTrajectory,
    TokenizedTrajectory,
    TokenizedTrajectoryGroup,
    Tokenizer,
    tokenize_trajectory,
)
from art.trajectories import History, LegacyHistory, Trajectory, TrajectoryGroup, TrajectoryHistory
from art.types import Messages, MessagesAndChoices, Tools, TrainConfig, TrainSFTConfig

Backend = RemoteBackend  # ART's name for the client of its HTTP server

__version__ = "0.1.0"

__all__ = [
    "AnthropicMessageSource",
    "AnthropicMessagesHistory",
    "ArtError",
    "ArtValueError",
    "AutoTrajectoryContext",
    "Backend",
    "BackendError",
    "ChatCompletionsExchange",
    "ChatCompletionsHistory",
    "ChatCompletionsMessageSource",
    "ChatCompletionsRequest",
    "CompletionsExchange",
    "CompletionsRequest",
    "CompletionsSource",
    "CompletionsStringHistory",
    "CompletionsStringSourceSpan",
    "CompletionsTokenHistory",
    "CompletionsTokenSourceSpan",
    "ContextLengthError",
    "DEFAULT_MODEL",
    "History",
    "LegacyHistory",
    "LocalBackend",
    "Messages",
    "MessagesAndChoices",
    "MessagesExchange",
    "MessagesRequest",
    "Model",
    "ModelNotFoundError",
    "PipelineRuntimeConfig",
    "PipelineTrainer",
    "RemoteBackend",
    "ResponsesExchange",
    "ResponsesHistory",
    "ResponsesItemSource",
    "ResponsesRequest",
    "StepConflictError",
    "TokenFlag",
    "TokenizedHistory",
    "TokenizedMultiHistoryTrajectory",
    "TokenizedTrajectory",
    "TokenizedTrajectoryGroup",
    "Tokenizer",
    "TooManyExceptionsError",
    "Tools",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryError",
    "TrajectoryExchanges",
    "TrajectoryGroup",
    "TrajectoryHistory",
    "auto_trajectory",
    "capture_auto_trajectory",
    "current_trajectory",
    "current_trajectory_group",
    "dev",
    "gather_trajectories",
    "gather_trajectory_groups",
    "make_group_rollout_fn",
    "no_capture",
    "retry",
    "tokenize_trajectory",
    "trajectory",
    "trajectory_group",
    "trajectory_group_batches",
    "utils",
]
