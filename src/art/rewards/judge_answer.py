"""The judge's answer: its JSON schema, and parsing that trusts nothing.

A judge asked for structured output (`response_format` json_schema) can only produce the
schema's shape; any other judge may wrap the JSON in prose or a code fence, skip or repeat a
trajectory, or score on another scale ("8/10", 80). Parsing finds the JSON object, validates it
with pydantic, requires exactly one score per trajectory id, brings scores to [0, 1] and clamps
what stays outside, counting each.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from art.numeric import is_int
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
    """The judge's answer cannot be used (not JSON, wrong shape, ids missing, repeated or
    unexpected). For a wrong set of ids, `got` (score objects in the answer), `missing`,
    `duplicate` and `unexpected` (trajectory ids) say what was wrong, so a retry can tell the
    judge; they are None for any other problem."""

    def __init__(
        self,
        message: str,
        *,
        got: int | None = None,
        missing: list[str] | None = None,
        duplicate: list[str] | None = None,
        unexpected: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.got, self.missing, self.duplicate, self.unexpected = got, missing, duplicate, unexpected

    @property
    def structural(self) -> bool:
        """Whether the answer parsed but scored the wrong set of trajectory ids."""
        return self.got is not None


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
        "properties": {
            "scores": {
                "type": "array",
                "prefixItems": [entry(i) for i in range(1, n + 1)],
                "items": False,
                "minItems": n,
                "maxItems": n,
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    }


def parse_answer(content: str | None, n: int) -> tuple[list[TrajectoryScore], int]:
    """(scores in trajectory order "1".."n", in [0, 1]; how many were clamped into it).

    A score may be a number or a string: "0.8", "8/10", "40%". Numbers on another scale are
    brought to [0, 1] by the answer's largest: all within 1 are taken as they are, else within
    10 they are tenths (8 -> 0.8), else within 100 hundredths; a fraction or a percentage says
    its own scale. What is still outside [0, 1] (a negative, past 100) is clamped and counted."""
    data: Any = _json_object(content or "")
    raw_scores = data.get("scores") if isinstance(data, dict) else None
    explicit: set[int] = set()
    if isinstance(raw_scores, list):
        data = {**data, "scores": [_plain_entry(entry, i, explicit) for i, entry in enumerate(raw_scores)]}
    try:
        answer = Response.model_validate(data)
    except ValidationError as exc:
        raise JudgeAnswerError(
            f"the answer does not match the schema: {exc.errors()[0]['msg']} "
            f"at {'.'.join(map(str, exc.errors()[0]['loc']))}"
        ) from exc
    expected = [str(i) for i in range(1, n + 1)]
    ids = [score.trajectory_id.strip() for score in answer.scores]
    _check_ids(ids, expected)
    values = [score.score for score in answer.scores]
    for key, value in zip(ids, values):
        if not math.isfinite(value):
            raise JudgeAnswerError(f"trajectory {key!r} has a non-finite score {value!r}")
    implicit = [abs(v) for i, v in enumerate(values) if i not in explicit]
    scale = next((s for s in SCALES if max(implicit, default=0.0) <= s), SCALES[-1])
    by_id: dict[str, TrajectoryScore] = {}
    clamped = 0
    for i, (key, score) in enumerate(zip(ids, answer.scores)):
        value = score.score if i in explicit else score.score / scale
        if not 0.0 <= value <= 1.0:
            clamped += 1
            value = min(1.0, max(0.0, value))
        by_id[key] = score.model_copy(update={"trajectory_id": key, "score": value})
    return [by_id[key] for key in expected], clamped


SCALES = (1.0, 10.0, 100.0)
"""The scales a judge's plain numbers are read on, the smallest that holds them all."""
_FRACTION = re.compile(r"^\s*([-+]?\d*\.?\d+)\s*/\s*(\d*\.?\d+)\s*$")
_PERCENT = re.compile(r"^\s*([-+]?\d*\.?\d+)\s*%\s*$")


def _plain_entry(entry: object, index: int, explicit: set[int]) -> object:
    """A score entry with a numeric id made a string and a string score made a number; the
    index goes into `explicit` when the score stated its scale ("8/10", "40%")."""
    if not isinstance(entry, dict):
        return entry
    entry = dict(entry)
    if is_int(entry.get("trajectory_id")):
        entry["trajectory_id"] = str(entry["trajectory_id"])
    score = entry.get("score")
    if isinstance(score, str):
        entry["score"] = _score_text(score, str(entry.get("trajectory_id", index + 1)))
        if _FRACTION.match(score) or _PERCENT.match(score):
            explicit.add(index)
    return entry


def _score_text(text: str, key: str) -> float:
    if fraction := _FRACTION.match(text):
        top, bottom = float(fraction.group(1)), float(fraction.group(2))
        if bottom == 0:
            raise JudgeAnswerError(f"trajectory {key!r} has score {text!r}, a fraction over 0")
        return top / bottom
    if percent := _PERCENT.match(text):
        return float(percent.group(1)) / 100
    try:
        return float(text)
    except ValueError:
        raise JudgeAnswerError(
            f"trajectory {key!r} has score {text!r}: not a number, a fraction such as '8/10' "
            "or a percentage such as '40%'"
        ) from None


def _check_ids(ids: list[str], expected: list[str]) -> None:
    """Exactly one score per expected id, or a structural JudgeAnswerError saying what differs
    (its message opens as ART's: "Expected 2 scores, but got 1")."""
    counts = Counter(ids)
    missing = [i for i in expected if i not in counts]
    duplicate = [i for i in counts if counts[i] > 1]
    unexpected = [i for i in counts if i not in set(expected)]
    if not (missing or duplicate or unexpected):
        return
    head = (
        f"Expected {len(expected)} scores, but got {len(ids)}"
        if len(ids) != len(expected)
        else f"Expected one score for each trajectory ID {', '.join(expected)}"
    )
    raise JudgeAnswerError(
        f"{head} (missing trajectory IDs: {listed(missing)}; duplicate trajectory IDs: {listed(duplicate)}; "
        f"unexpected trajectory IDs: {listed(unexpected)})",
        got=len(ids),
        missing=missing,
        duplicate=duplicate,
        unexpected=unexpected,
    )


def listed(ids: list[str]) -> str:
    """Ids as the judge is told them: "1, 2", or "none"."""
    return ", ".join(ids) if ids else "none"


def _json_object(content: str) -> object:
    data = json_in_text(content)
    if data is None:
        shown = content[:200] + ("..." if len(content) > 200 else "")
        raise JudgeAnswerError(f"the answer is not JSON: {shown!r}")
    return data
