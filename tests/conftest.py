"""Shared fixtures: a tiny random model with the real SmolLM2 tokenizer (fast, offline)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.models import save_tiny_llama

os.environ["WANDB_MODE"] = "disabled"  # tests that use W&B switch it to offline themselves
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template, saved as a HF folder."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-model"))


LONGEST_FIRST = (
    "tests/e2e/test_default_model_learns.py",
    "tests/engine/test_vllm_engine.py",
    "tests/service/test_ray_placement.py",
    "tests/observability/test_tracing.py",
    "tests/training/test_fsdp.py",
    "tests/server/test_schemathesis.py",
    "tests/training/test_ranks.py",
    "tests/e2e/test_pipeline.py",
    "tests/service/test_model_support.py",
)
"""The files that take longest (about a minute or more each, from the suite's --durations): run
first, so the two workers (pytest-xdist hands out whole files in this order) end together rather
than one finishing a long file alone."""


def pytest_collection_modifyitems(config, items):
    """Move the longest files to the front, each file's tests kept in their order."""
    root = config.rootpath

    def rank(item) -> int:
        path = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
