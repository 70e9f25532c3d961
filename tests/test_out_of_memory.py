"""A CUDA out-of-memory error in the middle of a training step (here raised on purpose after the
optimizer changed the weights: this machine has no GPU to exhaust) rolls the step back, names the
knob to turn, and leaves the model serving and training."""

from __future__ import annotations

import pytest
import torch

import art
from art.errors import ArtValueError


async def test_an_oom_during_a_step_rolls_back_and_names_the_knob(tiny_model_path, tmp_path, monkeypatch):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="oom", project="p", base_model=str(tiny_model_path))
    await model.register(backend)
    service = backend._services[("p", "oom")]
    client = model.openai_client()

    async def group(seed: int) -> art.TrajectoryGroup:
        trajectories = []
        for rank in range(4):
            completion = await client.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "Say a word."}], max_tokens=4, seed=seed + rank)
            trajectories.append(art.Trajectory(messages_and_choices=[completion.choices[0]], reward=float(rank)))
        return art.TrajectoryGroup(trajectories)

    before = {n: p.detach().clone() for n, p in service.model.named_parameters() if "lora_" in n}
    real_step = service.trainer.step

    def step_then_oom(*args, **kwargs):
        real_step(*args, **kwargs)  # the weights have moved...
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  # ...then memory ran out

    monkeypatch.setattr(service.trainer, "step", step_then_oom)
    with pytest.raises(ArtValueError) as info:
        await model.train([await group(0)], config=art.TrainConfig(learning_rate=1.0))
    assert info.value.field == "micro_batch_tokens"
    assert "rolled back" in str(info.value) and "gradient_checkpointing" in str(info.value)
    assert await model.get_step() == 0 and service.store.steps() == [0]
    after = {n: p.detach() for n, p in service.model.named_parameters() if "lora_" in n}
    assert all(torch.equal(after[n], before[n]) for n in before)

    monkeypatch.undo()
    await model.train([await group(10)], config=art.TrainConfig(learning_rate=1.0))  # still serves and trains
    assert await model.get_step() == 1
    await backend.close()
