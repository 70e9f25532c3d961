"""A step's groups as the sequences it trains, in mini-batches of packed micro-batches.

The first stages of the spine (`art.training.trainer`): advantages per group, token sequences
per trajectory (`art.training.sequences`), what was skipped and why (and which assistant turns
given as dicts are context), then the split into one mini-batch per optimizer step and each
mini-batch's micro-batches (`art.training.packing`): `pack_batch`, and `report_input` for
what the step reports (and warns) of its input.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from art.observability import tracing
from art.training import packing, sequences
from art.training.advantages import balance_advantage, group_advantages, reward_std, rewards_differ
from art.training.collective import Collective
from art.training.options import TrainOptions
from art.training.packing import MicroBatch
from art.training.sequences import (
    SEQUENCE_BREAK,
    UNUSED_ASSISTANT_DICT,
    Sequence,
    assistant_dict_turns,
    sequences_of_trajectory,
)

log = logging.getLogger(__name__)

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


@dataclass
class PackedBatch:
    """A step's groups as `pack_batch` made them: what trains, what was left out, and how
    this rank runs each mini-batch."""

    groups: list
    sequences: list[Sequence]
    issues: Counter
    """What was not used as given (`art.training.batch.describe`), by reason."""
    stats: dict[str, float]
    dicts: AssistantDicts
    parts: list[list[Sequence]]
    """The mini-batches, one optimizer step each (per epoch)."""
    plans: list[list[MicroBatch | None]]
    """This rank's micro-batches of each mini-batch; None is a sharded rank's filler pass."""


def pack_batch(groups: list, options: TrainOptions, collective: Collective) -> PackedBatch:
    """A step's sequences, its mini-batches and this rank's micro-batch plans of each (a
    sharded rank's padded with filler passes to the busiest rank's count)."""
    with tracing.span("art.train.pack") as pack:
        sequences, issues, stats = prepare_batch(groups, options)
        dicts = assistant_dicts(groups)
        parts = [part for part in split_mini_batches(sequences, options.mini_batches) if part]
        plans: list[list[MicroBatch | None]] = [
            list(plan_micro_batches(collective.shard(part), options)) for part in parts
        ]
        if collective.sharded:  # every rank runs as many passes as the busiest: fillers make up the rest
            most = [max(counts) for counts in zip(*collective.gather([len(p) for p in plans]))]
            plans = [plan + [None] * (n - len(plan)) for plan, n in zip(plans, most)]
        tracing.set_attributes(pack, {"art.sequences": len(sequences)})
    return PackedBatch(groups, sequences, issues, stats, dicts, parts, plans)


def report_input(batch: PackedBatch, options: TrainOptions) -> dict[str, float]:
    """What a step reports of its input, trained or not: the `skipped/<reason>` counts, the
    batch's statistics and context turns, with a warning for what was not used as given and,
    when nothing trains, `nothing_to_train` = 1 and a warning that says why (and, when every
    group's rewards were equal, what to do about it)."""
    issues, dicts, stats = batch.issues, batch.dicts, batch.stats
    breaks = issues.pop(SEQUENCE_BREAK, 0)  # trained all the same, each as a new sequence
    if dicts.unused:
        issues[UNUSED_ASSISTANT_DICT] = dicts.unused
    metrics: dict[str, float] = {f"skipped/{k}": float(v) for k, v in sorted(issues.items())}
    metrics.update(stats)
    metrics["learning_rate"] = options.learning_rate  # on every row, one with nothing to train too
    if dicts.context:  # few-shot demonstrations: context by design, not lost data
        metrics["context_assistant_turns"] = float(dicts.context)
    if breaks:
        metrics["sequence_breaks"] = float(breaks)
        log.info("%s", describe(Counter({SEQUENCE_BREAK: breaks})))
    no_signal = bool(batch.groups) and not stats["groups_trained"]
    if not batch.sequences:
        metrics["nothing_to_train"] = 1.0
        log.warning(
            "nothing to train in this step (%s); the step advances with unchanged weights.%s",
            describe(issues, dicts) or "no groups given",
            f" {NO_SIGNAL_HINT}" if no_signal else "",
        )
        return metrics
    if issues:
        log.warning("training input not used as given: %s", describe(issues, dicts))
    if no_signal:  # a KL or entropy term still trains, the reward does not
        log.warning("only the KL or entropy term trains in this step. %s", NO_SIGNAL_HINT)
    return metrics


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
