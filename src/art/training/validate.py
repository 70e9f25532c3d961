"""Training input checked before a step starts: what would crash the step or train garbage.

Refused with a 400 (`TrajectoryError`) that names the trajectory and the field, before any
weight moves:
- a reward that is not a finite number;
- token ids (`prompt_token_ids`, `token_ids`) that are not ints in [0, vocabulary);
- `logprobs.content` of another length than `token_ids`, or a logprob that is not a finite
  number <= 0;
- a turn whose prompt + completion is longer than the model's context (it cannot have been
  sampled by this model; truncating it would train on tokens it never saw together).

Skipped and counted instead (`train/skipped/<reason>`, `art.training.sequences`), because
they are normal input from elsewhere, not corrupt: a Choice without token ids or without
logprobs (from another server), groups whose rewards are equal, assistant turns given as dicts
with no Choice after them. Assistant dicts before a Choice are context (few-shot examples),
counted as `train/context_assistant_turns`.
"""

from __future__ import annotations

from art.errors import TrajectoryError
from art.naming import echo
from art.numeric import is_finite
from art.trajectories import is_choice

LOGPROB_SLACK = 1e-4
"""A logprob may exceed 0 by float rounding, not more."""


def check_groups(groups, *, vocab_size: int, context: int) -> None:
    """Raise TrajectoryError for the first malformed trajectory (field: its path in the train body)."""
    for g, group in enumerate(groups):
        for t, trajectory in enumerate(group.trajectories):
            where = f"trajectory_groups[{g}].trajectories[{t}]"
            reward = trajectory.reward
            if not is_finite(reward):
                raise TrajectoryError(
                    f"{where}.reward must be a finite number, got {echo(reward)}", field=f"{where}.reward"
                )
            histories = [("messages_and_choices", trajectory.messages_and_choices)]
            histories += [
                (f"additional_histories[{h}].messages_and_choices", history.messages_and_choices)
                for h, history in enumerate(getattr(trajectory, "additional_histories", None) or [])
            ]
            for name, items in histories:
                for k, item in enumerate(items):
                    if is_choice(item):
                        _check_choice(item, f"{where}.{name}[{k}]", vocab_size, context)


def _check_choice(choice, where: str, vocab_size: int, context: int) -> None:
    prompt = getattr(choice, "prompt_token_ids", None)
    completion = getattr(choice, "token_ids", None)
    for name, ids in (("prompt_token_ids", prompt), ("token_ids", completion)):
        if ids is None:
            continue
        if not isinstance(ids, (list, tuple)):
            raise TrajectoryError(
                f"{where}.{name} must be a list of token ids, got {echo(ids)}", field=f"{where}.{name}"
            )
        bad = next((i for i, x in enumerate(ids) if type(x) is not int or not 0 <= x < vocab_size), None)
        if bad is not None:
            raise TrajectoryError(
                f"{where}.{name}[{bad}] = {echo(ids[bad])}: token ids must be ints in "
                f"[0, {vocab_size}) (the model's vocabulary)",
                field=f"{where}.{name}[{bad}]",
            )
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if content and completion is not None:
        if len(content) != len(completion):
            raise TrajectoryError(
                f"{where}.logprobs.content has {len(content)} entries for {len(completion)} "
                "token_ids: one logprob per sampled token",
                field=f"{where}.logprobs.content",
            )
        for i, entry in enumerate(content):
            value = getattr(entry, "logprob", None)
            if not is_finite(value) or value > LOGPROB_SLACK:
                raise TrajectoryError(
                    f"{where}.logprobs.content[{i}].logprob must be a finite number <= 0, got {echo(value)}",
                    field=f"{where}.logprobs.content[{i}].logprob",
                )
    if prompt and completion is not None and len(prompt) + len(completion) > context:
        raise TrajectoryError(
            f"{where}: {len(prompt)} prompt + {len(completion)} completion tokens exceed the "
            f"model's context of {context} tokens",
            field=f"{where}.token_ids",
        )
