"""Agent Reinforcement Trainer: train LLM agents with GRPO on your own agent code.

The client side (this package's top level) imports no torch; `LocalBackend` loads the heavy
parts (install the `[backend]` extra) only when a trainable model is registered.
"""

from art import dev, utils
from art.backends.local import LocalBackend
from art.backends.remote import RemoteBackend
from art.base_models import DEFAULT_MODEL
from art.capture import (
    AutoTrajectoryContext,
    auto_trajectory,
    capture_auto_trajectory,
    current_trajectory,
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
from art.gather import gather_trajectories, gather_trajectory_groups, trajectory_group_batches
from art.model import Model, TrainableModel
from art.pipeline_trainer import PipelineTrainer, make_group_rollout_fn
from art._retry import retry
from art.trajectories import (
    ChatCompletionsExchange,
    History,
    ResponsesExchange,
    Trajectory,
    TrajectoryExchanges,
    TrajectoryGroup,
)
from art.types import Messages, MessagesAndChoices, Tools, TrainConfig, TrainSFTConfig

Backend = RemoteBackend  # ART's name for the client of its HTTP server

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "ArtError",
    "ArtValueError",
    "AutoTrajectoryContext",
    "Backend",
    "BackendError",
    "ChatCompletionsExchange",
    "ContextLengthError",
    "History",
    "LocalBackend",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "ModelNotFoundError",
    "PipelineTrainer",
    "RemoteBackend",
    "ResponsesExchange",
    "StepConflictError",
    "TooManyExceptionsError",
    "Tools",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryError",
    "TrajectoryExchanges",
    "TrajectoryGroup",
    "auto_trajectory",
    "capture_auto_trajectory",
    "current_trajectory",
    "dev",
    "gather_trajectories",
    "gather_trajectory_groups",
    "make_group_rollout_fn",
    "no_capture",
    "retry",
    "trajectory",
    "trajectory_group",
    "trajectory_group_batches",
    "utils",
]
