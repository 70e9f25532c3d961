"""Weave, the real package: ART's switch (WANDB_API_KEY) starts it at register, once per project.

W&B's trace server cannot be reached from here, so `weave.init` itself is replaced by a recorder;
everything else (the package, `@weave.op`, our register path) is real.
"""

from __future__ import annotations

import pytest
import weave

import art
from art.observability import weave_sink

pytestmark = pytest.mark.integration


@pytest.fixture
def inits(monkeypatch):
    calls = []
    monkeypatch.setattr(weave, "init", lambda project: calls.append(project))
    monkeypatch.setattr(weave_sink, "_projects", set())
    return calls


@pytest.mark.parametrize("env,expected", [
    ({"WANDB_API_KEY": "k"}, ["runs"]),
    ({}, []),
    ({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, []),
    ({"WANDB_API_KEY": "k", "WEAVE_DISABLED": "true"}, []),
], ids=["key", "no-key", "offline", "disabled"])
async def test_register_starts_weave_once_per_project_when_wandb_is_on(tmp_path, monkeypatch, inits, env, expected):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WEAVE_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    backend = art.LocalBackend(path=str(tmp_path))
    for name in ("a", "b"):  # prompted models: no weights loaded
        await art.Model(name=name, project="runs", inference_base_url="http://127.0.0.1:9/v1").register(backend)
    assert inits == expected
    await backend.close()


async def test_a_failing_weave_init_does_not_stop_registration(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_API_KEY", "k")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the suite disables W&B
    monkeypatch.setattr(weave_sink, "_projects", set())

    def unreachable(project):
        raise ConnectionError("W&B is unreachable")

    monkeypatch.setattr(weave, "init", unreachable)
    backend = art.LocalBackend(path=str(tmp_path))
    await art.Model(name="a", project="runs", inference_base_url="http://127.0.0.1:9/v1").register(backend)
    assert "weave.init('runs') failed" in caplog.text
    await backend.close()
