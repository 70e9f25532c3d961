"""The weight-sync probe (design invariant 2): after every update the engine's logprobs on a fixed
probe must match the trainer's; a real serving-path fault fails the step loudly and rolls it back."""

from __future__ import annotations

import json
import re

import pytest

import art
from art.errors import WeightSyncError
from art.service import probe
from art.storage.layout import ModelDir
from tests.support.rollouts import groups, rollout

pytestmark = pytest.mark.integration


def served_numbers(message: str) -> tuple[list[float], list[float]]:
    served, trained = re.findall(r"\[(-?\d[^\]]*)\]", message.split("tokens", 1)[1])[:2]
    return [float(x) for x in served.split(",")], [float(x) for x in trained.split(",")]


async def test_probe_passes_then_catches_stale_serving_and_rolls_back(tiny_model_path, tmp_path, monkeypatch):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="sync", project="p", base_model=str(tiny_model_path))
    await model.register(backend)
    service = backend.service.loaded(("p", "sync"))
    checkpoints = ModelDir(tmp_path, "p", "sync").checkpoints

    # Normally: the metric is there (and logged as train/...), the two sides agree to float noise.
    await model.train(await groups(model, 0), config=art.TrainConfig(learning_rate=1.0))
    history = [json.loads(line) for line in ModelDir(tmp_path, "p", "sync").history.read_text().splitlines()]
    assert 0 <= history[-1]["train/weight_sync_max_abs_diff"] < 1e-4

    # Fault 1, a poisoned prefix cache: the probe prompt's KV computed with step 1's weights is
    # filed under step 2's key (what a cache not keyed by weights would do).
    prompt = probe.probe_prompt(service.tokenizer)
    length, stale = service.engine.prefix_cache.longest("default@1", prompt)
    assert length == len(prompt) and stale is not None  # the probe of step 1 left it there
    service.engine.prefix_cache.put("default@2", prompt, stale)
    with pytest.raises(WeightSyncError) as failed:
        await backend.train(model, await groups(model, 1), learning_rate=1.0)
    message = str(failed.value)
    assert "engine served logprobs" in message and "trainer computes" in message and "rolled back" in message
    served, trained = served_numbers(message)
    assert len(served) == len(trained) == probe.PROBE_TOKENS
    assert max(abs(a - b) for a, b in zip(served, trained)) > probe.TOLERANCE
    # Rolled back: step, checkpoints on disk and served weights are those of step 1 again.
    assert await model.get_step() == 1 and service.store.steps() == [0, 1]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["0000", "0001"]
    service.engine.prefix_cache.drop("default@2")

    # Fault 2, stale live-step bookkeeping: the engine is never told about the update, so it
    # serves the probe as step 1 (and from step 1's cached prefix) although step 2 was trained.
    monkeypatch.setattr(service.engine, "weights_updated", lambda step, checkpoint: None)
    with pytest.raises(WeightSyncError, match=r"the weights of step 1 sampled it, not step 2"):
        await backend.train(model, await groups(model, 1), learning_rate=1.0)
    assert await model.get_step() == 1 and service.store.steps() == [0, 1]
    monkeypatch.undo()

    # With the fault gone the same update trains, passes the probe and advances.
    result = await backend.train(model, await groups(model, 1), learning_rate=1.0)
    assert result.step == 2 and await model.get_step() == 2
    assert result.metrics[probe.METRIC] < 1e-4
    await backend.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_probe_catches_a_stale_merged_copy(tiny_model_path, tmp_path, monkeypatch, dtype):
    """Live-adapter batches run on a merged copy of the weights; if a weight update did not reach
    it, the probe sees the old weights served and rolls the step back. In bf16 too, where the
    tolerance is wider (HALF_TOLERANCE) but a real update still moves logprobs far past it."""
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="merge", project="p", base_model=str(tiny_model_path),
                               _internal_config={"engine_args": {"dtype": dtype, "merge_lora": True}})
    await model.register(backend)
    service = backend.service.loaded(("p", "merge"))
    assert service.trainer.dtype == getattr(__import__("torch"), dtype)
    async def ranked_groups(step: int) -> list[art.TrajectoryGroup]:
        """Rewards that differ within each group, so every step really trains."""
        trajectories = [await rollout(model, 10 * step + i) for i in range(4)]
        for rank, trajectory in enumerate(trajectories):
            trajectory.reward = float(rank)
        return [art.TrajectoryGroup(trajectories)]

    result = await backend.train(model, await ranked_groups(0), learning_rate=1.0)
    assert "nothing_to_train" not in result.metrics
    assert result.metrics[probe.METRIC] <= probe.tolerance_for(service.trainer.dtype)

    monkeypatch.setattr(service.engine.runner, "weights_changed", lambda **_: None)
    with pytest.raises(WeightSyncError, match="rolled back"):
        await backend.train(model, await ranked_groups(1), learning_rate=1.0)
    assert await model.get_step() == 1
    monkeypatch.undo()
    result = await backend.train(model, await ranked_groups(1), learning_rate=1.0)
    assert result.step == 2
    await backend.close()
