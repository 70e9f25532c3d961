"""What a step says about its input: assistant turns given as dicts (few-shot context counted as
such, warned only when they train nothing) and groups whose rewards are all equal (what to do).

A real Trainer on the tiny model takes the step, so the metrics and the warnings checked are
the ones `model.train` logs (locally, and on the server behind `art serve`).
"""

import logging
from types import SimpleNamespace

import art
from art.training.options import TrainOptions
from art.training.trainer import Trainer
from tests.support.fakes import groups_of_choices, make_choice
from tests.training.test_trainer_options import lora_model

FEW_SHOT = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "Is water wet?"},
    {"role": "assistant", "content": "yes"},  # a demonstration: context, never trained
    {"role": "user", "content": "Is fire cold?"},
    {"role": "assistant", "content": "no"},
]


def with_few_shot(groups):
    for group in groups:
        for trajectory in group.trajectories:
            trajectory.messages_and_choices = [*FEW_SHOT, *trajectory.messages_and_choices]
    return groups


def training_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("art.")]


def test_few_shot_assistant_dicts_before_the_choice_are_context_without_a_warning(tiny_model_path, caplog):
    groups = with_few_shot(groups_of_choices(groups=2, samples=4))
    trainer = Trainer(lora_model(tiny_model_path), SimpleNamespace(pad_token_id=0))
    with caplog.at_level(logging.INFO):
        metrics = trainer.step(groups, TrainOptions(learning_rate=1e-3), quiet=True)
    assert metrics["context_assistant_turns"] == 2 * 4 * 2  # two per trajectory, eight trajectories
    assert not [k for k in metrics if k.startswith("skipped/")], metrics
    assert metrics["sequences"] == 8.0 and metrics["trained_tokens"] > 0
    assert training_warnings(caplog) == []


def test_a_trajectory_whose_assistant_turns_are_all_dicts_is_warned_once_by_name(tiny_model_path, caplog):
    groups = with_few_shot(groups_of_choices(groups=2, samples=4))
    # The likely mistake: the sampled answer appended as a dict (its text) instead of the Choice.
    typed = art.Trajectory(messages_and_choices=[*FEW_SHOT, {"role": "user", "content": "x"},
                                                 {"role": "assistant", "content": "maybe"}], reward=0.3)
    groups[1].trajectories.append(typed)
    groups[1].trajectories.append(typed.model_copy(deep=True))
    trainer = Trainer(lora_model(tiny_model_path), SimpleNamespace(pad_token_id=0))
    with caplog.at_level(logging.INFO):
        metrics = trainer.step(groups, TrainOptions(learning_rate=1e-3), quiet=True)
    (warning,) = training_warnings(caplog)
    assert "trajectory_groups[1].trajectories[4]" in warning and "trajectory_groups[1].trajectories[5]" in warning
    assert "Choice" in warning and "dict" in warning
    assert metrics["skipped/trajectory_without_trainable_choice"] == 2.0
    # With no Choice after them, none of their three dict turns is context for anything trained.
    assert metrics["skipped/assistant_dict_after_last_choice"] == 2 * 3
    assert metrics["context_assistant_turns"] == 2 * 8
    assert metrics["sequences"] == 8.0  # the rest trains as before


def test_an_assistant_dict_after_the_last_choice_is_warned_but_earlier_ones_are_not(tiny_model_path, caplog):
    (group,) = groups_of_choices(groups=1, samples=2)
    first, second = group.trajectories
    first.messages_and_choices = [*FEW_SHOT, *first.messages_and_choices, {"role": "user", "content": "and?"},
                                  {"role": "assistant", "content": "typed after the last Choice"}]
    second.messages_and_choices = [*FEW_SHOT, *second.messages_and_choices, {"role": "user", "content": "and?"},
                                   make_choice([1, 2, 3], [4, 5])]
    trainer = Trainer(lora_model(tiny_model_path), SimpleNamespace(pad_token_id=0))
    with caplog.at_level(logging.INFO):
        metrics = trainer.step([group], TrainOptions(learning_rate=1e-3), quiet=True)
    (warning,) = training_warnings(caplog)
    assert "trajectory_groups[0].trajectories[0]" in warning and "trajectories[1]" not in warning
    assert metrics["skipped/assistant_dict_after_last_choice"] == 1.0
    assert metrics["context_assistant_turns"] == 4.0


def test_equal_rewards_under_a_regularizer_still_say_what_to_do(tiny_model_path, caplog):
    """With an entropy bonus every sample trains (advantage 0): the step is not empty, but the
    reward taught nothing, and the warning says how to get rewards that differ."""
    groups = groups_of_choices(groups=2, samples=2)
    for group in groups:
        for trajectory in group.trajectories:
            trajectory.reward = 0.0
    trainer = Trainer(lora_model(tiny_model_path), SimpleNamespace(pad_token_id=0))
    with caplog.at_level(logging.INFO):
        metrics = trainer.step(groups, TrainOptions(learning_rate=1e-3, entropy_bonus=0.01), quiet=True)
    assert metrics["sequences"] == 4.0 and "nothing_to_train" not in metrics
    (warning,) = training_warnings(caplog)
    assert "only the KL or entropy term trains" in warning and "demonstration" in warning
