"""Trajectories -> token sequences with a trained mask, built only from the engine's token ids.

Each `Choice` carries the exact prompt ids and completion ids it was sampled from (vLLM's
`prompt_token_ids` / `token_ids`) and per-token logprobs. A multi-turn trajectory becomes one
sequence while each next prompt extends the ids so far (tool results and user turns are then
context); when it does not, a new sequence starts. Only sampled completion tokens are trained.
Nothing here re-tokenises text. Message dicts, assistant turns included, are context only:
`assistant_dict_turns` counts the assistant ones.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from art.trajectories import is_choice  # a model Choice (trained), not a message dict (context)

# Reasons a part of the input is not trained; reported in metrics under `skipped/<reason>`
# (SEQUENCE_BREAK is trained, as a new sequence: counted as `sequence_breaks`).
NO_TOKEN_IDS = "choice_without_token_ids"
NO_LOGPROBS = "choice_without_logprobs"
UNUSED_ASSISTANT_DICT = "assistant_dict_after_last_choice"  # trains nothing and is context for nothing
NO_CHOICES = "trajectory_without_trainable_choice"
SEQUENCE_BREAK = "turn_prompt_does_not_extend_previous_tokens"  # still trained, as a new sequence


@dataclass
class Sequence:
    """One row of training input. Lists are aligned, one entry per token."""

    token_ids: list[int] = field(default_factory=list)  # [tokens]
    trained: list[bool] = field(default_factory=list)  # [tokens] True for sampled tokens
    sampler_logprobs: list[float] = field(default_factory=list)  # [tokens] NaN where not trained
    advantage: float = 0.0
    group: int = -1
    """Index of the trajectory group it came from (its samples share a prompt)."""
    member: int = -1
    """Index of its trajectory within the group."""
    ordinal: int = -1
    """Its place among its trajectory's sequences (the numbering `art.training.audit` shows)."""
    trainer_logprobs: list[float | None] | None = None
    """[tokens] The trainer's logprob of each trained token at its first forward pass; None elsewhere."""

    def extend(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.token_ids += ids
        self.trained += [logprobs is not None] * len(ids)
        self.sampler_logprobs += logprobs if logprobs is not None else [math.nan] * len(ids)

    @property
    def num_trained(self) -> int:
        return sum(self.trained)


def choice_tokens(choice) -> tuple[list[int], list[int], list[float]] | str:
    """(prompt ids, completion ids, completion logprobs) of a Choice, or why it is unusable."""
    prompt = getattr(choice, "prompt_token_ids", None)
    completion = getattr(choice, "token_ids", None)
    if not prompt or completion is None:
        return NO_TOKEN_IDS
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if not content or len(content) != len(completion):
        return NO_LOGPROBS
    return list(prompt), list(completion), [float(entry.logprob) for entry in content]


@dataclass(frozen=True)
class Break:
    """A turn whose prompt ids do not extend the conversation's ids so far (a new sequence
    starts there): usually a chat template that re-renders earlier turns differently."""

    choice: int
    """Index of the choice in messages_and_choices."""
    position: int
    """First token position where the prompt differs from the ids so far."""
    expected: int | None
    """Token id the earlier turns had there (None: the new prompt is shorter)."""
    got: int | None


def sequences_of_history(messages_and_choices, issues: Counter, breaks: list[Break] | None = None) -> list[Sequence]:
    """Token sequences of one conversation; `issues` counts what could not be used and
    `breaks`, when given, collects where a turn did not extend the previous ids."""
    sequences: list[Sequence] = []
    current: Sequence | None = None
    for index, item in enumerate(messages_and_choices):
        if not is_choice(item):
            continue  # context: the prompt ids of the next Choice hold it as the engine rendered it
        parts = choice_tokens(item)
        if isinstance(parts, str):
            issues[parts] += 1
            continue
        prompt, completion, logprobs = parts
        if current is not None and prompt[: len(current.token_ids)] == current.token_ids:
            current.extend(prompt[len(current.token_ids) :], None)
        else:
            if current is not None:
                issues[SEQUENCE_BREAK] += 1
                if breaks is not None:
                    breaks.append(_first_difference(index, current.token_ids, prompt))
            current = Sequence()
            current.extend(prompt, None)
            sequences.append(current)
        current.extend(completion, logprobs)
    return sequences


def assistant_dict_turns(messages_and_choices) -> tuple[int, int]:
    """(context, unused): assistant turns given as message dicts before the conversation's last
    Choice, which it was sampled after (few-shot demonstrations), and after it (or with no
    Choice at all), which shape nothing that trains."""
    last_choice = max((i for i, item in enumerate(messages_and_choices) if is_choice(item)), default=-1)
    context = unused = 0
    for index, item in enumerate(messages_and_choices):
        if isinstance(item, dict) and item.get("role") == "assistant":
            if index < last_choice:
                context += 1
            else:
                unused += 1
    return context, unused


def _first_difference(choice: int, so_far: list[int], prompt: list[int]) -> Break:
    for position, (a, b) in enumerate(zip(so_far, prompt)):
        if a != b:
            return Break(choice, position, a, b)
    return Break(choice, len(prompt), so_far[len(prompt)], None)


def sequences_of_trajectory(trajectory, issues: Counter) -> list[Sequence]:
    """The main history and every `additional_histories` entry (same advantage later)."""
    out = sequences_of_history(trajectory.messages_and_choices, issues)
    for history in getattr(trajectory, "additional_histories", None) or []:
        out += sequences_of_history(history.messages_and_choices, issues)
    for ordinal, sequence in enumerate(out):
        sequence.ordinal = ordinal
    if not any(s.num_trained for s in out):
        issues[NO_CHOICES] += 1
    return [s for s in out if s.num_trained]
