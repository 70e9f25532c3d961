"""Small helpers for training loops: resumable dataset iteration and concurrency limits."""

from art._retry import retry  # ART's `art.utils.retry` too

from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency

__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry"]
