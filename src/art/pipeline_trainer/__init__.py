"""`art.PipelineTrainer`: rollouts overlap training, with a bound on how stale a trained group may be.

ART's 2026 names: `PipelineTrainer`, `PipelineRuntimeConfig`, `make_group_rollout_fn`, the
checkpoint retention helpers (`keep_recent_and_top`) and the `checkpoint/*` history metric names,
and the function types. `trainer.py` holds the stages; `keywords.py` turns ART's keyword arguments
into `settings.py`'s frozen settings (`config.py` is ART's runtime config); `admission.py` the
staleness gate; `state.py` what survives a kill; `checkpoint_retention.py` which checkpoints are
kept.
"""

from art.pipeline_trainer.checkpoint_retention import (
    CHECKPOINT_CREATED_AT_METRIC,
    CHECKPOINT_EVAL_COMPLETED_METRIC,
    CHECKPOINT_SAVED_METRIC,
    CheckpointInfo,
    CheckpointRetentionContext,
    CheckpointRetentionPlan,
    CheckpointRetentionStrategy,
    keep_recent_and_periodic,
    keep_recent_and_top,
    plan_checkpoint_retention,
)
from art.pipeline_trainer.config import PipelineRuntimeConfig
from art.pipeline_trainer.trainer import PipelineTrainer
from art.pipeline_trainer.types import EvalFn, RolloutFn, ScenarioT, SingleRolloutFn, make_group_rollout_fn

__all__ = [
    "CHECKPOINT_CREATED_AT_METRIC",
    "CHECKPOINT_EVAL_COMPLETED_METRIC",
    "CHECKPOINT_SAVED_METRIC",
    "CheckpointInfo",
    "CheckpointRetentionContext",
    "CheckpointRetentionPlan",
    "CheckpointRetentionStrategy",
    "EvalFn",
    "PipelineRuntimeConfig",
    "PipelineTrainer",
    "RolloutFn",
    "ScenarioT",
    "SingleRolloutFn",
    "keep_recent_and_periodic",
    "keep_recent_and_top",
    "plan_checkpoint_retention",
    "make_group_rollout_fn",
]
