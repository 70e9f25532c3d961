"""`art.PipelineTrainer`: rollouts overlap training, with a bound on how stale a trained group may be.

ART's 2026 names: `PipelineTrainer`, `make_group_rollout_fn`, the checkpoint retention helpers
(`keep_recent_and_top`) and the function types. `trainer.py` holds the stages, `state.py` what
survives a kill, `checkpoint_retention.py` which checkpoints are kept.
"""

from art.pipeline_trainer.checkpoint_retention import (
    CheckpointInfo,
    CheckpointRetentionContext,
    CheckpointRetentionStrategy,
    keep_recent_and_top,
)
from art.pipeline_trainer.trainer import PipelineTrainer, make_group_rollout_fn
from art.pipeline_trainer.types import EvalFn, RolloutFn, ScenarioT, SingleRolloutFn

__all__ = [
    "CheckpointInfo",
    "CheckpointRetentionContext",
    "CheckpointRetentionStrategy",
    "EvalFn",
    "PipelineTrainer",
    "RolloutFn",
    "ScenarioT",
    "SingleRolloutFn",
    "keep_recent_and_top",
    "make_group_rollout_fn",
]
