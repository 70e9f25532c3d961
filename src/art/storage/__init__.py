"""On-disk layout of a run: `{root}/{project}/models/{name}/`. Every write is crash-safe."""

from art.storage.checkpoints import CheckpointStore
from art.storage.history import append_history, read_history
from art.storage.layout import ModelDir

__all__ = ["CheckpointStore", "ModelDir", "append_history", "read_history"]
