"""The pieces of `art.PipelineTrainer` that need no model: its resume state, checkpoint
retention, how a trajectory is dated, its settings, and ART's `backend.train` keywords."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

import art
from art.backends.adapter import art_train_names
from art.errors import ArtValueError
from art.pipeline_trainer import (
    CheckpointInfo,
    CheckpointRetentionContext,
    CheckpointRetentionPlan,
    keep_recent_and_periodic,
    keep_recent_and_top,
    plan_checkpoint_retention,
)
from art.pipeline_trainer.state import PipelineState
from art.trajectories import History, Trajectory, TrajectoryGroup, policy_versions


def test_state_keeps_a_watermark_and_the_used_scenarios_past_it():
    state = PipelineState()
    for index in (2, 0, 5):
        state.use_up(index)
    assert (state.scenario_offset, state.used_after_offset) == (1, [2, 5])
    assert [state.is_used(i) for i in range(7)] == [True, False, True, False, False, True, False]
    state.use_up(1)  # 0, 1, 2 are used up: the watermark moves over them
    assert (state.scenario_offset, state.used_after_offset) == (3, [5])
    state.use_up(1)  # using up twice changes nothing
    assert (state.scenario_offset, state.used_after_offset) == (3, [5])
    again = PipelineState.from_saved(state.saved())
    assert again == state


def test_state_from_saved_ignores_unknown_and_mistyped_keys():
    state = PipelineState.from_saved({"scenario_offset": 4, "used_after_offset": "bad", "training_step": "7",
                                      "someone_elses": 1, "completed_eval_steps": [0, 2]})
    assert (state.scenario_offset, state.used_after_offset, state.training_step) == (4, [], 0)
    assert state.completed_eval_steps == [0, 2]
    assert PipelineState.from_saved(None) == PipelineState()


def _infos(rewards: dict[int, float | None]) -> CheckpointRetentionContext:
    now = datetime.now(timezone.utc)
    return CheckpointRetentionContext(current_step=max(rewards) + 1, checkpoints=[
        CheckpointInfo(step=s, path=f"checkpoints/{s:04d}", created_at=now,
                       metrics={} if r is None else {"val/reward": r}) for s, r in rewards.items()])


def test_strategies_return_the_steps_to_keep_as_arts_plan():
    """ART's contract: a strategy sees every checkpoint and returns a plan of the steps to keep
    (and to archive); the pipeline deletes the deletable ones it does not keep."""
    art_example = _infos({0: None, 1: 0.2, 2: None, 3: 0.8, 4: None, 5: None})
    assert keep_recent_and_top(recent=2, top=1)(art_example).retain_steps == {3, 4, 5}
    context = _infos({1: 0.9, 2: None, 3: 0.2, 4: 0.9, 5: None, 6: 0.1, 7: None})
    assert keep_recent_and_top(recent=2, top=1)(context).retain_steps == {4, 6, 7}  # a tie keeps the later step
    assert keep_recent_and_top(recent=0, top=2)(context).retain_steps == {1, 4}
    assert keep_recent_and_top(recent=3, top=0)(context).retain_steps == {5, 6, 7}
    assert keep_recent_and_top(recent=1, top=1, metric="val/other")(context).retain_steps == {7}
    assert keep_recent_and_top(recent=0, top=0)(context).retain_steps == set()
    for bad, message in (({"recent": -1}, "recent must be >= 0"), ({"top": -1}, "top must be >= 0")):
        with pytest.raises(ValueError, match=message):
            keep_recent_and_top(**bad)

    periodic = keep_recent_and_periodic(recent=2, archive_interval=2, archives=2)(_infos(dict.fromkeys(range(7))))
    assert (periodic.retain_steps, periodic.archive_steps) == ({5, 6}, {4, 6})
    with pytest.raises(ValueError, match="archive_interval must be >= 1"):
        keep_recent_and_periodic(archive_interval=0)


def test_a_plan_deletes_only_deletable_steps_and_keeps_what_is_archived():
    infos = _infos(dict.fromkeys(range(6))).checkpoints
    seen = []

    def keep_newest(context):
        seen.append({c.step: c.deletion_eligible for c in context.checkpoints})
        return CheckpointRetentionPlan(retain_steps={5})

    plan = plan_checkpoint_retention(current_step=5, checkpoints=infos, protected_steps={5, 1}, strategy=keep_newest)
    assert seen == [{0: True, 1: False, 2: True, 3: True, 4: True, 5: False}]
    assert plan.retain_steps == {1, 5} and plan.observed_steps == set(range(6))  # 1 is protected
    archived = plan_checkpoint_retention(current_step=5, checkpoints=infos, protected_steps={5},
                                         strategy=lambda c: CheckpointRetentionPlan(archive_steps={2}))
    assert archived.retain_steps == {2, 5}  # no archive store here: an archived step stays
    assert plan_checkpoint_retention(current_step=5, checkpoints=infos, protected_steps=set(),
                                     strategy=lambda c: CheckpointRetentionPlan(retain_steps=set(range(6)))) is None
    with pytest.raises(ValueError, match=r"unknown steps: \[9\]"):
        plan_checkpoint_retention(current_step=5, checkpoints=infos, protected_steps=set(),
                                  strategy=lambda c: CheckpointRetentionPlan(retain_steps={9}))
    # bare steps meant "keep" in one ART release and "delete" in another: refused, nothing deleted
    with pytest.raises(ValueError, match="must return a CheckpointRetentionPlan") as refused:
        plan_checkpoint_retention(current_step=5, checkpoints=infos, protected_steps=set(), strategy=lambda c: {0, 1})
    assert refused.value.field == "checkpoint_retention_strategy"


def _choice(step: int | None) -> Choice:
    choice = Choice(index=0, finish_reason="stop", message=ChatCompletionMessage(role="assistant", content="a"))
    if step is not None:
        choice.step = step  # what our server adds to every choice
    return choice


def test_a_trajectory_is_as_old_as_its_oldest_turn():
    spans = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, _choice(3),
                                             {"role": "user", "content": "more"}, _choice(5)],
                       additional_histories=[History(messages_and_choices=[_choice(2)])])
    assert policy_versions(spans, started=4, ended=6) == (2, 5)
    from_json = Choice.model_validate({"index": 0, "finish_reason": "stop", "step": 1,
                                       "message": {"role": "assistant", "content": "a"}})
    assert policy_versions(Trajectory(messages_and_choices=[from_json]), 4, 6) == (1, 1)
    # Choices of a server that reports no step: dated by when the rollout ran.
    assert policy_versions(Trajectory(messages_and_choices=[_choice(None)]), started=4, ended=6) == (4, 6)


def test_art_train_keywords_map_to_ours():
    assert art_train_names({"loss_fn": "ppo", "learning_rate": 1e-5}) == {"ppo": True, "learning_rate": 1e-5}
    assert art_train_names({"loss_fn": "cispo", "normalize_advantages": False}) == {"ppo": False,
                                                                                     "scale_rewards": False}
    assert art_train_names({"save_checkpoint": False, "verbose": True, "loss_fn_config": None, "adam_params": None,
                            "kl_penalty_coef": 0.0}) == {}
    with pytest.raises(ArtValueError, match="loss_fn must be one of 'cispo', 'ppo', got 'dpo'") as bad:
        art_train_names({"loss_fn": "dpo"})
    assert bad.value.field == "loss_fn"
    with pytest.raises(ArtValueError, match="disagree"):
        art_train_names({"loss_fn": "ppo", "ppo": False})
    with pytest.raises(ArtValueError, match="adam_params") as bad:
        art_train_names({"adam_params": {"beta1": 0.8}})
    assert bad.value.field == "adam_params"


def test_the_loss_default_is_art_s_cispo():
    from art.training.options import TrainOptions

    options = TrainOptions()
    assert options.ppo is False
    assert TrainOptions(ppo=True).ppo is True


async def _rollout(model, scenario, config) -> TrajectoryGroup:
    return TrajectoryGroup([Trajectory(reward=1.0)])


@pytest.mark.parametrize("settings, field", [
    ({"num_rollout_workers": 0}, "num_rollout_workers"),
    ({"min_batch_size": 4, "max_batch_size": 2}, "max_batch_size"),
    ({"max_steps_off_policy": -1}, "max_steps_off_policy"),
    ({"max_steps_off_policy": True}, "max_steps_off_policy"),
    ({"stale_groups": "keep"}, "stale_groups"),
    ({"stale_groups": "wait", "max_steps_off_policy": None}, "stale_groups='wait'"),
    ({"log_interval_seconds": 0}, "log_interval_seconds"),
])
def test_pipeline_trainer_names_the_bad_setting(settings, field):
    with pytest.raises(ArtValueError, match="invalid PipelineTrainer settings") as bad:
        art.PipelineTrainer(object(), object(), _rollout, [1, 2], None, **settings)
    assert field in str(bad.value)


def test_pipeline_trainer_defaults_are_art_s():
    trainer = art.PipelineTrainer(object(), object(), _rollout, [1, 2], None)
    assert trainer.max_steps_off_policy == 4
    assert trainer.train_kwargs["loss_fn"] == "cispo"
    assert (trainer.eval_every_n_steps, trainer.eval_at_start, trainer.save_checkpoint, trainer.resume) == (
        20, True, True, True)
    assert trainer.max_batch_size == 10 * trainer.min_batch_size


async def test_make_group_rollout_fn_keeps_failures_in_the_group():
    calls = 0

    async def single(model, scenario, config) -> Trajectory:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("one rollout failed")
        return Trajectory(reward=float(scenario + calls))

    group = await art.make_group_rollout_fn(single, n=3)(None, 10, None)
    assert sorted(t.reward for t in group.trajectories) == [11.0, 13.0]
    assert [e.type for e in group.exceptions] == ["RuntimeError"]


def test_a_dated_trajectory_crosses_the_wire():
    from art.server.management_schemas import TrajectoryPayload

    dated = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, _choice(3)], reward=1.0,
                       initial_policy_version=3, final_policy_version=4)
    back = TrajectoryPayload.model_validate(dated.for_logging()).to_trajectory("t")
    assert (back.initial_policy_version, back.final_policy_version) == (3, 4)
    assert TrajectoryPayload.model_validate(Trajectory(reward=0.0).for_logging()).initial_policy_version is None
