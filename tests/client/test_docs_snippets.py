"""The Python snippets of docs/*.md run as written, against a real served model."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

import art
from art.training.sequences import sequences_of_trajectory

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs"


def snippets(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


def test_every_docs_page_with_python_is_covered_here():
    pages = sorted(p.name for p in DOCS.glob("*.md") if snippets(p.name))
    assert pages == ["art-compatibility.md"]  # a new page with snippets gets a test below


async def test_anthropic_agent_of_the_compatibility_page_records_and_trains(tiny_model_path, tmp_path):
    [code] = snippets("art-compatibility.md")
    namespace: dict = {}
    exec(compile(code, "art-compatibility.md", "exec"), namespace)
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="docs", project="snippets", base_model=str(tiny_model_path))
    await model.register(backend)
    try:
        trajectories = [await namespace["rollout"](model, "Say yes.") for _ in range(2)]
        for trajectory in trajectories:
            [call] = trajectory.exchanges.messages
            assert call.response.model_extra["token_ids"] and call.request["messages"][0]["content"] == "Say yes."
            [sequence] = sequences_of_trajectory(trajectory, Counter())
            assert sequence.token_ids[-len(call.response.model_extra["token_ids"]):] == call.response.model_extra[
                "token_ids"]
        trajectories[0].reward, trajectories[1].reward = 1.0, 0.0  # a signal, whatever the tiny model said
        await model.train([art.TrajectoryGroup(trajectories)], config=art.TrainConfig(learning_rate=1e-3))
        assert await model.get_step() == 1
    finally:
        await backend.close()
