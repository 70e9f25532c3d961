"""ART's `get_trajectory_messages`: a trajectory as plain chat messages."""

from __future__ import annotations

from art.trajectories import Trajectory
from art.types import Messages


def get_trajectory_messages(trajectory: Trajectory) -> Messages:
    """The trajectory's `messages_and_choices` as message dicts, each Choice as the assistant
    message it carries (`Trajectory.messages()`). Unlike ART's, an assistant turn keeps its
    `tool_calls`: dropping them would show the next tool result answering nothing."""
    return trajectory.messages()
