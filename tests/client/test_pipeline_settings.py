"""PipelineTrainer's settings on their own (`art.pipeline_trainer.settings`): every problem named at
once, and the derived sizes the rollout gate plans with."""

from __future__ import annotations

import warnings

import pytest

from art.pipeline_trainer.config import PipelineRuntimeConfig
from art.pipeline_trainer.settings import PipelineSettings, runtime_config


def settings(**changes) -> PipelineSettings:
    values = dict(
        num_rollout_workers=4, min_batch_size=2, max_batch_size=None, queue_maxsize=None, max_steps_off_policy=2,
        limit_mean_steps_off_policy=None, stale_groups="drop", max_steps=None, discard_queue_multiplier=100,
        eval_every_n_steps=20, checkpoint_retention_interval=1, total_scenarios=None, log_interval_seconds=60.0,
    )
    return PipelineSettings(**{**values, **changes})


def test_every_problem_is_named_at_once():
    problems = settings(num_rollout_workers=0, max_batch_size=1, stale_groups="later", max_steps=True,
                        log_interval_seconds=0).problems()
    assert [p.split(" ", 1)[0] for p in problems] == [
        "num_rollout_workers", "max_steps", "max_batch_size", "stale_groups", "log_interval_seconds"]
    assert settings().problems() == []
    assert settings(stale_groups="wait", max_steps_off_policy=None).problems() == [
        "stale_groups='wait' needs a max_steps_off_policy to wait for"]


def test_the_derived_sizes():
    assert settings().batch_cap == 20 and settings(max_batch_size=3).batch_cap == 3
    assert settings().age_bound == 2
    assert settings(max_steps_off_policy=None, limit_mean_steps_off_policy=1.2).age_bound == 2
    assert settings(max_steps_off_policy=None).age_bound is None
    assert settings(max_batch_size=3).queue_limit == 6  # one batch per step a group may lag
    assert settings(max_batch_size=3, max_steps_off_policy=0).queue_limit == 3  # at least one batch
    assert settings(queue_maxsize=5).queue_limit == 5


def test_direct_runtime_settings_are_deprecated_and_refused_beside_a_config():
    with pytest.warns(DeprecationWarning, match="pipeline=PipelineRuntimeConfig"):
        config, given, problems = runtime_config(None, {"min_batch_size": 3, "queue_maxsize": None})
    assert given == {"min_batch_size": 3} and problems == [] and config == PipelineRuntimeConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, given, problems = runtime_config(PipelineRuntimeConfig(), {"min_batch_size": 3})
    assert problems and problems[0].startswith("min_batch_size: Use either")
