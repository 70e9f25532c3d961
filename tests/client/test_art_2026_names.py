"""ART's 2026 names around the pipeline, needing no model: `PipelineRuntimeConfig` and the
trainer's keywords (with their mutual-exclusion errors), the mean-lag measure, the `checkpoint/*`
metric names, `summarize_trajectory_groups`, `ArtVllmMetricsTimeoutError` and `run_name`."""

from __future__ import annotations

import warnings

import pydantic
import pytest

import art
from art.errors import ArtValueError, ArtVllmMetricsTimeoutError, BackendError
from art.pipeline_trainer import (
    CHECKPOINT_CREATED_AT_METRIC,
    CHECKPOINT_EVAL_COMPLETED_METRIC,
    CHECKPOINT_SAVED_METRIC,
    PipelineRuntimeConfig,
    PipelineTrainer,
)
from art.pipeline_trainer.trainer import mean_steps_off_policy
from art.metrics_taxonomy import build_data_metrics_from_summary, summarize_trajectory_groups
from tests.support.fakes import make_choice


async def _rollout(model, scenario, config):
    return art.TrajectoryGroup([art.Trajectory(reward=1.0)])


def trainer(**settings) -> PipelineTrainer:
    return PipelineTrainer(object(), object(), _rollout, [1, 2], None, **settings)


def test_the_runtime_config_has_arts_fields_defaults_and_errors():
    config = PipelineRuntimeConfig()
    assert (config.num_rollout_workers, config.min_batch_size, config.max_batch_size, config.queue_maxsize) == (
        16, 4, None, None)
    assert (config.score_reference_groups_per_step, config.score_reference_rollouts_per_group) == (8.0, None)
    with pytest.raises(pydantic.ValidationError, match="max_batch_size must be >= min_batch_size"):
        PipelineRuntimeConfig(min_batch_size=4, max_batch_size=2)
    with pytest.raises(pydantic.ValidationError, match="max_steps_off_policy"):  # a trainer keyword, not a size
        PipelineRuntimeConfig(max_steps_off_policy=2)
    with pytest.raises(pydantic.ValidationError, match="num_rollout_workers"):
        PipelineRuntimeConfig(num_rollout_workers=0)


def test_the_trainer_sizes_itself_from_pipeline_or_the_deprecated_keywords():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pipeline= is ART's current spelling: no warning
        sized = trainer(pipeline=PipelineRuntimeConfig(num_rollout_workers=3, min_batch_size=2, queue_maxsize=7))
    assert (sized.num_rollout_workers, sized.min_batch_size, sized.max_batch_size, sized.queue_maxsize) == (3, 2, 20, 7)
    assert sized.pipeline.num_rollout_workers == 3 and sized.max_steps_off_policy == 4

    with pytest.warns(DeprecationWarning, match="pass pipeline=PipelineRuntimeConfig"):
        legacy = trainer(num_rollout_workers=3, min_batch_size=2, queue_maxsize=7)
    assert (legacy.num_rollout_workers, legacy.min_batch_size, legacy.max_batch_size, legacy.queue_maxsize) == (
        3, 2, 20, 7)
    assert legacy.pipeline == sized.pipeline


@pytest.mark.parametrize("settings, field", [
    ({"pipeline": PipelineRuntimeConfig(), "min_batch_size": 2}, "min_batch_size"),
    ({"pipeline": {"num_rollout_workers": 2}}, "pipeline"),
    ({"limit_mean_steps_off_policy": -0.5}, "limit_mean_steps_off_policy"),
    ({"kl_penalty_step_lag": 0}, "kl_penalty_step_lag"),
    ({"kl_penalty_coef": 0.25}, "kl_penalty_coef"),
    ({"grad_accumulation_sequences": 0}, "grad_accumulation_sequences"),
    ({"optimizer_save_interval": 0}, "optimizer_save_interval"),
    ({"score_reference_groups_per_step": 0.0}, "score_reference_groups_per_step"),
    ({"rollout_executor": object()}, "rollout_executor"),
])
def test_arts_keywords_are_checked_and_named(settings, field):
    with pytest.raises(ArtValueError, match="invalid PipelineTrainer settings") as bad:
        trainer(**settings)
    assert bad.value.field == field and field in str(bad.value)


def test_pipeline_and_the_deprecated_keywords_exclude_each_other_with_arts_message():
    with pytest.raises(ValueError, match=r"Use either pipeline=PipelineRuntimeConfig\(\.\.\.\) or deprecated direct "
                                         r"pipeline settings, not both\."):
        trainer(pipeline=PipelineRuntimeConfig(), num_rollout_workers=2, queue_maxsize=3)


def test_autotuning_other_than_off_is_refused_and_off_is_accepted():
    class Autotune:
        def __init__(self, mode):
            self.mode = mode

    assert trainer(autotune=Autotune("off")).num_rollout_workers == 16
    with pytest.raises(ArtValueError, match="autotuning") as bad:
        trainer(autotune=Autotune("online"))
    assert bad.value.field == "autotune"


def test_the_mean_limit_alone_plans_for_its_ceiling_and_max_stays_a_trainer_keyword():
    limited = trainer(max_steps_off_policy=None, limit_mean_steps_off_policy=1.5,
                      pipeline=PipelineRuntimeConfig(min_batch_size=2, max_batch_size=3))
    assert limited.max_steps_off_policy is None and limited.limit_mean_steps_off_policy == 1.5
    assert limited.queue_maxsize == 2 * 3  # ceil(1.5) steps of max_batch_size groups


def test_mean_steps_off_policy_weights_each_trajectory_by_its_completion_tokens():
    def sampled(version: int, completion: int) -> art.Trajectory:
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                    make_choice([1, 2], list(range(3, 3 + completion)))],
                              reward=0.0, initial_policy_version=version)

    group = art.TrajectoryGroup([sampled(5, 2), sampled(2, 6), art.Trajectory(reward=1.0)])
    # lags 1, 4 and (undated, from the group's version 3) 3; weights 2, 6 and at least 1
    assert mean_steps_off_policy(group, 6, 3) == pytest.approx((1 * 2 + 4 * 6 + 3 * 1) / 9)
    assert mean_steps_off_policy(art.TrajectoryGroup([]), 6, 4) == 2.0


def test_checkpoint_metric_names_are_arts():
    assert (CHECKPOINT_SAVED_METRIC, CHECKPOINT_CREATED_AT_METRIC, CHECKPOINT_EVAL_COMPLETED_METRIC) == (
        "checkpoint/saved", "checkpoint/created_at_unix", "checkpoint/eval_completed")


def test_summarize_trajectory_groups_counts_as_a_train_row_does():
    groups = [
        art.TrajectoryGroup([art.Trajectory(reward=0.0), art.Trajectory(reward=1.0)], metadata={"scenario_id": "s1"}),
        art.TrajectoryGroup([art.Trajectory(reward=0.5, metadata={"scenario_id": "s2"}), art.Trajectory(reward=0.5)],
                            exceptions=[ValueError("boom")]),
        art.TrajectoryGroup([art.Trajectory(reward=1.0)], metadata={"scenario_id": "s1"}),
    ]
    summary = summarize_trajectory_groups(groups)
    assert (summary.num_scenarios, summary.num_trajectories, summary.num_groups_submitted,
            summary.num_groups_trainable, summary.scenario_ids) == (3, 6, 3, 1, ["s1", "s2"])
    assert build_data_metrics_from_summary(summary, include_trainable_groups=False) == {
        "data/step_num_scenarios": 3.0, "data/step_num_trajectories": 6.0, "data/step_num_groups_submitted": 3.0}
    trainable = build_data_metrics_from_summary(summary, include_trainable_groups=True)
    assert trainable["data/step_num_groups_trainable"] == 1.0


def test_the_engine_metrics_timeout_is_a_backend_error_and_a_timeout():
    error = ArtVllmMetricsTimeoutError("Timed out collecting ART vLLM metrics from http://127.0.0.1:1.")
    assert isinstance(error, BackendError) and isinstance(error, TimeoutError)


def test_run_name_may_differ_from_the_served_name():
    model = art.TrainableModel(name="agent", project="p", base_model="tiny", run_name="agent-run-2")
    assert (model.name, model.run_name, model.get_inference_name()) == ("agent", "agent-run-2", "agent")
    assert art.TrainableModel(name="agent", project="p", base_model="tiny").run_name == "agent"
    with pytest.raises(ArtValueError) as bad:
        art.TrainableModel(name="agent", project="p", base_model="tiny", run_name="  ")
    assert bad.value.field == "run_name"


ART_TRAINER_KEYWORDS = """num_rollout_workers min_batch_size max_batch_size queue_maxsize pipeline autotune learning_rate
    loss_fn loss_fn_config normalize_advantages grad_accumulation_sequences adam_params kl_penalty_coef
    kl_penalty_step_lag max_steps discard_queue_multiplier max_steps_off_policy limit_mean_steps_off_policy
    score_reference_groups_per_step score_reference_rollouts_per_group log_interval_seconds status_ewa_alpha
    total_scenarios eval_every_n_steps eval_at_start save_checkpoint optimizer_save_interval
    checkpoint_retention_strategy checkpoint_retention_interval resume rollout_executor""".split()


def test_the_trainer_takes_every_keyword_of_arts():
    import inspect

    parameters = inspect.signature(PipelineTrainer.__init__).parameters
    missing = [name for name in ART_TRAINER_KEYWORDS if name not in parameters]
    assert not missing
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ART_TRAINER_KEYWORDS)
    assert parameters["max_steps_off_policy"].default == 4 and parameters["limit_mean_steps_off_policy"].default is None
