"""Rewards computed for you: RULER, a judge model's relative scores of a group (ART's API)."""

from art.rewards.judge_answer import Response, TrajectoryScore
from art.rewards.judge_cache import JudgeCache
from art.rewards.judge_prompt import DEFAULT_RUBRIC
from art.rewards.ruler import RulerAnswerError, RulerStats, ruler, ruler_score_group

__all__ = [
    "DEFAULT_RUBRIC",
    "JudgeCache",
    "Response",
    "RulerAnswerError",
    "RulerStats",
    "TrajectoryScore",
    "ruler",
    "ruler_score_group",
]
