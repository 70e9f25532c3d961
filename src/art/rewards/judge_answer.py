"""The judge's answer: its JSON schema, and parsing that trusts nothing.

A judge asked for structured output (`response_format` json_schema) can only produce the
schema's shape; any other judge may wrap the JSON in prose or a code fence, skip or repeat a
trajectory, or score outside [0, 1]. Parsing finds the JSON object, validates it with pydantic,
requires exactly one score per trajectory id, and clamps scores into [0, 1], counting each.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field, ValidationError

from art.utils.json_in_text import json_in_text

MAX_EXPLANATION = 200
"""Characters of explanation the schema allows per trajectory (keeps a small judge from rambling)."""


class TrajectoryScore(BaseModel):
    """One trajectory's score (ART's class)."""

    trajectory_id: str = Field(description="The id of the trajectory being scored.")
    explanation: str = Field(description="A short description of the trajectory's performance.")
    score: float = Field(description="A score between 0 and 1.")


class Response(BaseModel):
    """The judge's whole answer (ART's class and name: its JSON schema is named after it)."""

    scores: list[TrajectoryScore] = Field(description="The scores for each trajectory.")


class JudgeAnswerError(ValueError):
    """The judge's answer cannot be used (not JSON, wrong shape, ids missing or repeated)."""


def answer_schema(n: int) -> dict:
    """The JSON schema of an answer for `n` trajectories: exactly one entry per id, "1".."n" in
    order (prefixItems), so a constrained judge cannot skip or repeat one. A judge that refuses
    the schema is asked for a plain JSON object instead (`ruler`)."""
    def entry(i: int) -> dict:
        return {
            "type": "object",
            "properties": {
                "trajectory_id": {"type": "string", "enum": [str(i)]},
                "explanation": {"type": "string", "maxLength": MAX_EXPLANATION},
                # multipleOf bounds the digits: unbounded, a small judge can write them forever.
                "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
            },
            "required": ["trajectory_id", "explanation", "score"],
            "additionalProperties": False,
        }

    return {
        "type": "object",
        "properties": {"scores": {"type": "array", "prefixItems": [entry(i) for i in range(1, n + 1)],
                                  "items": False, "minItems": n, "maxItems": n}},
        "required": ["scores"],
        "additionalProperties": False,
    }


def parse_answer(content: str | None, n: int) -> tuple[list[TrajectoryScore], int]:
    """(scores in trajectory order "1".."n", how many were clamped into [0, 1])."""
    data = _json_object(content or "")
    try:
        answer = Response.model_validate(data)
    except ValidationError as exc:
        raise JudgeAnswerError(f"the answer does not match the schema: {exc.errors()[0]['msg']} "
                               f"at {'.'.join(map(str, exc.errors()[0]['loc']))}") from exc
    by_id: dict[str, TrajectoryScore] = {}
    for score in answer.scores:
        key = score.trajectory_id.strip()
        if key in by_id:
            raise JudgeAnswerError(f"trajectory {key!r} was scored twice")
        by_id[key] = score
    expected = [str(i) for i in range(1, n + 1)]
    missing = [i for i in expected if i not in by_id]
    unknown = sorted(set(by_id) - set(expected))
    if missing or unknown:
        raise JudgeAnswerError(f"the answer must score trajectories {expected} once each; missing {missing}, "
                               f"unknown {unknown}")
    clamped = 0
    out = []
    for key in expected:
        score = by_id[key]
        if not math.isfinite(score.score):
            raise JudgeAnswerError(f"trajectory {key!r} has a non-finite score {score.score!r}")
        if not 0.0 <= score.score <= 1.0:
            clamped += 1
            score = score.model_copy(update={"score": min(1.0, max(0.0, score.score))})
        out.append(score.model_copy(update={"trajectory_id": key}))
    return out, clamped


def _json_object(content: str) -> object:
    data = json_in_text(content)
    if data is None:
        shown = content[:200] + ("..." if len(content) > 200 else "")
        raise JudgeAnswerError(f"the answer is not JSON: {shown!r}")
    return data
