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
