"""A step's groups as the sequences it trains, in mini-batches of packed micro-batches.

The first stages of the spine (`art.training.trainer`): advantages per group, token sequences
per trajectory (`art.training.sequences`), what was skipped and why (and which assistant turns
given as dicts are context), then the split into one mini-batch per optimizer step and each
mini-batch's micro-batches (`art.training.packing`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from art.training import packing, sequences
from art.training.advantages import balance_advantage, group_advantages, reward_std, rewards_differ
from art.training.options import TrainOptions
from art.training.packing import MicroBatch
from art.training.sequences import Sequence, assistant_dict_turns, sequences_of_trajectory

EQUAL_REWARDS = "group_rewards_all_equal"
NO_SIGNAL_HINT = (
    "Every group's rewards were equal, so GRPO has nothing to compare. To get rewards that differ: add a "
    "demonstration (one good example conversation as plain messages before the sampled turn), use a graded "
    "(shaping) reward instead of 0/1, constrain the format with response_format, or run model.train_sft on a "
    "few good examples first."
)
"""What to do when no group has signal: the usual cold start, where the base model never
produces what the reward asks for (docs/troubleshooting.md)."""
NAMED_AT_MOST = 5
"""Trajectories named in a warning; the rest are counted."""


@dataclass
class AssistantDicts:
    """A step's assistant turns given as message dicts rather than Choices. Those before a
    Choice of their conversation are context it was sampled after (few-shot demonstrations):
    counted, not reported. Those after the last Choice train nothing and are context for
    nothing: almost always a sampled answer appended as its text instead of as the Choice."""

    context: int = 0
    unused: int = 0
    unused_in: list[str] = field(default_factory=list)
    """The trajectories that hold unused ones, by their path in the train body."""


def assistant_dicts(groups) -> AssistantDicts:
    found = AssistantDicts()
    for g, group in enumerate(groups):
        for t, trajectory in enumerate(group.trajectories):
            histories = [trajectory.messages_and_choices]
            histories += [h.messages_and_choices for h in getattr(trajectory, "additional_histories", None) or []]
            unused_here = 0
            for history in histories:
                context, unused = assistant_dict_turns(history)
                found.context += context
                unused_here += unused
            if unused_here:
                found.unused += unused_here
                found.unused_in.append(f"trajectory_groups[{g}].trajectories[{t}]")
    return found


def prepare_batch(groups, options: TrainOptions) -> tuple[list[Sequence], Counter, dict[str, float]]:
    """Advantages per group, then sequences; skips (and counts) what carries no signal. With a
    KL or entropy term every sample is kept, advantage 0 included: the regularizer must also
    act where the rewards are equal, which is where a collapsed policy's groups end up."""
    issues: Counter = Counter()
    sequences: list[Sequence] = []
    trained_groups = 0
    regularized = options.beta > 0 or options.entropy_bonus > 0
    groups = [list(group.trajectories) for group in groups]
    batch_std = reward_std([float(t.reward) for group in groups for t in group])
    for index, trajectories in enumerate(groups):
        rewards = [float(t.reward) for t in trajectories]
        if rewards_differ(rewards):
            trained_groups += 1
        elif not regularized:
            issues[EQUAL_REWARDS] += 1
            continue
        advantages = group_advantages(rewards, scale_rewards=options.reward_scaling, batch_std=batch_std)
        for member, (trajectory, advantage) in enumerate(zip(trajectories, advantages)):
            advantage = balance_advantage(advantage, options.advantage_balance)
            for sequence in sequences_of_trajectory(trajectory, issues):
                if advantage == 0.0 and not regularized:
                    continue  # contributes no gradient
                sequence.advantage = advantage
                sequence.group, sequence.member = index, member
                sequences.append(sequence)
    return sequences, issues, {"groups_trained": float(trained_groups)}


def split_mini_batches(sequences: list[Sequence], parts: int) -> list[list[Sequence]]:
    """`parts` contiguous slices of near-equal size, in group order (so groups stay together
    when there are at least as many groups as parts)."""
    ordered = sorted(sequences, key=lambda s: s.group)
    size, extra = divmod(len(ordered), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(ordered[start:end])
        start = end
    return out


def plan_micro_batches(sequences: list[Sequence], options: TrainOptions) -> list[MicroBatch]:
    groups: dict[int, list[Sequence]] = {}
    for s in sequences:
        groups.setdefault(s.group, []).append(s)
    return packing.plan(
        list(groups.values()),
        mode=options.packing,
        row_tokens=options.packed_row_tokens,
        batch_tokens=options.micro_batch_tokens,
    )


def describe(issues: Counter, dicts: AssistantDicts | None = None) -> str:
    """One line: each reason with its count; `dicts` names where the unused assistant dicts are."""
    hints = {
        EQUAL_REWARDS: "groups whose rewards are all equal carry no signal",
        sequences.NO_TOKEN_IDS: "choices without prompt_token_ids/token_ids (not from an art backend?)",
        sequences.NO_LOGPROBS: "choices without logprobs matching their token ids",
        sequences.UNUSED_ASSISTANT_DICT: "assistant turns given as dicts with no Choice after them, so they "
        "neither train nor serve as context (append the Choice itself, e.g. completion.choices[0], to train a "
        "turn)" + (f" in {_named(dicts.unused_in)}" if dicts is not None and dicts.unused_in else ""),
        sequences.NO_CHOICES: "trajectories with no trainable Choice",
        sequences.SEQUENCE_BREAK: "turns whose prompt ids do not extend the earlier "
        "ids (trained as a new sequence; see art.training.audit)",
    }
    return "; ".join(f"{n} x {hints.get(reason, reason)}" for reason, n in sorted(issues.items()))


def _named(paths: list[str]) -> str:
    more = len(paths) - NAMED_AT_MOST
    return ", ".join(paths[:NAMED_AT_MOST]) + (f" and {more} more" if more > 0 else "")
