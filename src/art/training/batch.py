"""A step's groups as the sequences it trains, in mini-batches of packed micro-batches.

The first stages of the spine (`art.training.trainer`): advantages per group, token sequences
per trajectory (`art.training.sequences`), what was skipped and why, then the split into one
mini-batch per optimizer step and each mini-batch's micro-batches (`art.training.packing`).
"""

from __future__ import annotations

from collections import Counter

from art.training import packing, sequences
from art.training.advantages import balance_advantage, group_advantages, reward_std, rewards_differ
from art.training.options import TrainOptions
from art.training.packing import MicroBatch
from art.training.sequences import Sequence, sequences_of_trajectory

EQUAL_REWARDS = "group_rewards_all_equal"


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
    return packing.plan(list(groups.values()), mode=options.packing, row_tokens=options.packed_row_tokens,
                        batch_tokens=options.micro_batch_tokens)


def describe(issues: Counter) -> str:
    hints = {
        EQUAL_REWARDS: "groups whose rewards are all equal carry no signal",
        sequences.NO_TOKEN_IDS: "choices without prompt_token_ids/token_ids (not from an art backend?)",
        sequences.NO_LOGPROBS: "choices without logprobs matching their token ids",
        sequences.ASSISTANT_DICT: "assistant turns given as dicts are context only; append the Choice to train it",
        sequences.NO_CHOICES: "trajectories with no trainable Choice",
        sequences.SEQUENCE_BREAK: "turns whose prompt ids do not extend the earlier "
        "ids (trained as a new sequence; see art.training.audit)",
    }
    return "; ".join(f"{n} x {hints.get(reason, reason)}" for reason, n in sorted(issues.items()))
