"""An OpenEnv environment's client drives rollouts that train (examples/openenv_echo.py).

The environment is served by OpenEnv's own server helpers in this process on loopback; each
rollout holds its own client session (WebSocket), resets, acts once, and takes the
environment's reward. Two `backend.train` steps on the tiny random model.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import art

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv_echo.py"


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("openenv.core", reason="openenv-core is not installed (see examples/openenv_echo.py's "
                                               "install line: --no-deps, without gradio)")
    spec = importlib.util.spec_from_file_location("openenv_echo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_environments_client_drives_rollouts_that_train(example, tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="echo", project="openenv", base_model=str(tiny_model_path))
    await model.register(backend)
    try:
        with example.serve_echo_env(max_sessions=8) as url:
            async with example.EchoEnv(base_url=url) as env:  # the environment itself, through its client
                ready = await env.reset()
                assert ready.observation.echoed_message == "Echo environment ready!" and ready.reward == 0.0
                echoed = await env.step(example.EchoAction(message="hello"))
                assert (echoed.observation.echoed_message, echoed.reward, echoed.done) == ("hello", 0.5, True)
                assert (await env.state()).step_count == 1

            async with example.EchoEnv(base_url=url) as env:
                trajectory = await example.rollout(model, env, max_tokens=6, seed=3)
            reply = trajectory.messages_and_choices[-1].message.content.strip()
            assert trajectory.reward == pytest.approx(len(reply) * example.REWARD_PER_CHAR)

            rows = await example.train(backend, model, url, steps=2, groups_per_step=2, group_size=2, max_tokens=6)
        assert [row["step"] for row in rows] == [0, 1] and await model.get_step() == 2
        # Every token the sampler produced trained, as its own ids.
        assert all(row["trained_tokens"] == row["produced_tokens"] > 0 and row["exact_id_share"] == 1.0
                   for row in rows)
        history = [json.loads(line) for line in
                   (tmp_path / "openenv" / "models" / "echo" / "history.jsonl").read_text().splitlines()]
        assert [row["step"] for row in history] == [1, 2] and "train/reward" in history[0]
    finally:
        await backend.close()
