"""Advantages, loss formula, and which tokens of a multi-turn trajectory are trained."""

import math
from collections import Counter

import pytest
import torch
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message import ChatCompletionMessage

import art
from art.training.advantages import group_advantages
from art.training.loss import policy_loss_terms
from art.training.options import TrainOptions
from art.training.sequences import (
    NO_LOGPROBS, NO_TOKEN_IDS, SEQUENCE_BREAK, assistant_dict_turns, sequences_of_trajectory,
)
from art.training.batch import EQUAL_REWARDS, prepare_batch
from tests.support.fakes import make_choice


def test_group_advantages_scaled_and_centred():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # std 0.5 -> (±0.5)/0.5
    assert group_advantages([3.0, 1.0], scale_rewards=False) == [1.0, -1.0]
    assert group_advantages([2.0, 2.0]) == [0.0, 0.0]


def test_policy_loss_matches_hand_computation():
    new = torch.tensor([[math.log(0.5), math.log(0.9)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.9)]])
    mask = torch.tensor([[1.0, 1.0]])
    # token 1: ratio 2.0, A=1 -> clipped to 1.2 -> loss -1.2; token 2: ratio 1 -> loss -1
    terms = policy_loss_terms(new, old, torch.tensor([1.0]), mask, epsilon=0.2)
    assert float(terms["loss"].detach()) == pytest.approx(-2.2, abs=1e-6)
    assert float(terms["clipped_tokens"]) == 1.0
    # negative advantage: min(2*-1, 1.2*-1) = -2 -> loss +2 (not clipped); token 2 -> +1
    terms = policy_loss_terms(new, old, torch.tensor([-1.0]), mask, epsilon=0.2, epsilon_high=0.5)
    assert float(terms["loss"]) == pytest.approx(3.0, abs=1e-6)
    # k3 KL: ref = new - log 2 -> delta = -log2: exp(-log2) + log2 - 1 = 0.5 + 0.6931 - 1
    ref = new.detach() - math.log(2)
    terms = policy_loss_terms(new, old, torch.tensor([0.0]), mask, epsilon=0.2, beta=0.1, ref_logprobs=ref)
    kl = 0.5 + math.log(2) - 1
    assert float(terms["kl"]) == pytest.approx(2 * kl, abs=1e-6)
    assert float(terms["loss"]) == pytest.approx(0.1 * 2 * kl, abs=1e-6)


def test_masked_tokens_do_not_contribute():
    new = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[float("nan"), -1.0]])
    terms = policy_loss_terms(new, old.nan_to_num(0), torch.tensor([1.0]), torch.tensor([[0.0, 1.0]]), epsilon=0.2)
    terms["loss"].backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] != 0


def test_multi_turn_tool_trajectory_trains_only_sampled_tokens():
    system_user = [1, 2, 3, 4]
    turn1 = make_choice(system_user, [10, 11, 12], [-0.1, -0.2, -0.3])
    tool_result_ids = [20, 21]  # the tool message as the template renders it: context
    turn2 = make_choice(system_user + [10, 11, 12] + tool_result_ids, [30, 31], [-0.4, -0.5])
    trajectory = art.Trajectory(messages_and_choices=[
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
        turn1,
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        turn2,
    ], reward=1.0)
    issues = Counter()
    (seq,) = sequences_of_trajectory(trajectory, issues)
    assert seq.token_ids == [1, 2, 3, 4, 10, 11, 12, 20, 21, 30, 31]
    assert seq.trained == [False] * 4 + [True] * 3 + [False] * 2 + [True] * 2
    trained_lps = [lp for lp, t in zip(seq.sampler_logprobs, seq.trained) if t]
    assert trained_lps == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert not issues


def test_non_extending_prompt_starts_a_new_sequence_and_dicts_are_context():
    first = make_choice([1, 2], [3])
    second = make_choice([1, 9, 9], [4, 5])  # history was rewritten: does not extend [1, 2, 3]
    trajectory = art.Trajectory(messages_and_choices=[
        first, {"role": "assistant", "content": "typed by hand"}, second,
        make_choice([1], [2], with_logprobs=False),
    ], reward=0.0)
    issues = Counter()
    seqs = sequences_of_trajectory(trajectory, issues)
    assert [s.token_ids for s in seqs] == [[1, 2, 3], [1, 9, 9, 4, 5]]
    assert issues == Counter({NO_LOGPROBS: 1, SEQUENCE_BREAK: 1})  # the dict is context, not an issue
    assert assistant_dict_turns(trajectory.messages_and_choices) == (1, 0)
    after_the_last = [{"role": "user", "content": "q"}, first, {"role": "assistant", "content": "a"}]
    assert assistant_dict_turns(after_the_last) == (0, 1)
    assert assistant_dict_turns([{"role": "assistant", "content": "a"}]) == (0, 1)  # no Choice at all


def test_prepare_batch_counts_what_cannot_train():
    good = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[make_choice([1, 2], [3])], reward=1.0),
        art.Trajectory(messages_and_choices=[make_choice([1, 2], [4])], reward=0.0),
    ])
    flat = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[make_choice([1], [3])], reward=0.5),
        art.Trajectory(messages_and_choices=[make_choice([1], [3])], reward=0.5),
    ])
    untokenised = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[Choice(index=0, finish_reason="stop",
                                                    message=ChatCompletionMessage(role="assistant", content="a"))],
                       reward=r) for r in (0.0, 1.0)
    ])
    sequences, issues, stats = prepare_batch([good, flat, untokenised], TrainOptions())
    assert len(sequences) == 2
    assert sorted(s.advantage for s in sequences) == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert issues[EQUAL_REWARDS] == 1 and issues[NO_TOKEN_IDS] == 2
    assert stats["groups_trained"] == 2.0


def test_train_options_report_every_bad_field():
    with pytest.raises(art.ArtValueError) as info:
        TrainOptions.build(art.TrainConfig(learning_rate=1e-5), {"epsilon": -1, "max_grad_norm": 0, "bogus": 1})
    message = str(info.value)
    assert "epsilon" in message and "max_grad_norm" in message and "bogus" in message
    assert info.value.field == "bogus"  # the unknown key first, then fields in declaration order
    with pytest.raises(art.ArtValueError) as info:
        TrainOptions.build(None, {"epsilon": -1, "max_grad_norm": 0})
    assert info.value.field == "max_grad_norm"
