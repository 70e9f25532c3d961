"""Training steps that fail or are stopped roll back, say why (naming the option to change), and
leave the model serving and training: a CUDA out-of-memory error mid-step, a diverging loss,
a cancelled step (DELETE on the train route, or a client that leaves with cancel_on_disconnect)."""

from __future__ import annotations

import pytest
import torch

import art
from art.errors import ArtValueError
from art.service.local import LocalService

pytestmark = pytest.mark.integration


async def test_an_oom_during_a_step_rolls_back_and_names_the_knob(tiny_model_path, tmp_path, monkeypatch):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="oom", project="p", base_model=str(tiny_model_path))
    await model.register(backend)
    service = backend.service.loaded(("p", "oom"))
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


async def group_of(model, seed: int, rewards=(0.0, 1.0, 2.0, 3.0)) -> art.TrajectoryGroup:
    client = model.openai_client()
    trajectories = []
    for rank, reward in enumerate(rewards):
        completion = await client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Say a word."}], max_tokens=4, seed=seed + rank)
        trajectories.append(art.Trajectory(messages_and_choices=[completion.choices[0]], reward=reward))
    return art.TrajectoryGroup(trajectories)


def lora_weights(service) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in service.model.named_parameters() if "lora_" in n}


async def test_a_diverging_step_is_a_400_naming_learning_rate_and_rolls_back(tiny_model_path, tmp_path):
    """Rewards of 1e38 without std scaling overflow the float32 loss: refused before the optimizer
    applies the gradient, rolled back, and the model goes on."""
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="nan", project="p", base_model=str(tiny_model_path))
    await model.register(backend)
    service = backend.service.loaded(("p", "nan"))
    before = lora_weights(service)
    with pytest.raises(ArtValueError) as info:
        await backend.train(model, [await group_of(model, 0, rewards=(0.0, 1e38, -1e38, 0.0))],
                            learning_rate=1.0, scale_rewards=False)
    assert info.value.field == "learning_rate" and "diverged" in str(info.value) and "rolled back" in str(info.value)
    assert await model.get_step() == 0
    assert all(torch.equal(p, before[n]) for n, p in lora_weights(service).items())
    await backend.train(model, [await group_of(model, 10)], learning_rate=1e-2)
    assert await model.get_step() == 1
    await backend.close()


async def test_cancelled_steps_roll_back(tiny_model_path, tmp_path):
    """DELETE on the train route stops a running step (its stream ends with a 409
    `step_cancelled`, RemoteBackend raises StepCancelledError), and so does a client that
    disconnects when it asked for cancel_on_disconnect; either way nothing is trained."""
    import asyncio
    import json

    import httpx

    from art.errors import StepCancelledError
    from art.serve import create_serve_app
    from art.server.thread import ServerThread

    local = LocalService(str(tmp_path))
    with ServerThread(create_serve_app(local, watchdog_s=None, watchdog_train_s=None)) as server:
        async with art.RemoteBackend(server.base_url) as remote:
            model = art.TrainableModel(name="stop", project="p", base_model=str(tiny_model_path))
            await model.register(remote)
            service = local.loaded(("p", "stop"))
            before = lora_weights(service)
            groups = [await group_of(model, 0)]
            assert await remote.cancel_training(model) is False  # nothing running

            started = asyncio.Event()
            long_step = asyncio.create_task(remote.train(  # 100 epochs: seconds of work
                model, groups, learning_rate=1e-3, epochs=100,
                progress=lambda event: started.set() if event.get("type") == "gradient_step" else None))
            await started.wait()
            assert await remote.cancel_training(model) is True
            with pytest.raises(StepCancelledError):
                await long_step
            assert await model.get_step() == 0 and service.store.steps() == [0]
            assert all(torch.equal(p, before[n]) for n, p in lora_weights(service).items())

            # A client that leaves, having asked for cancel_on_disconnect.
            body = {"trajectory_groups": [g.for_logging() for g in groups], "options": {"epochs": 100},
                    "cancel_on_disconnect": True}
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                async with http.stream("POST", "/art/models/p/stop/train", content=json.dumps(body, default=str),
                                       headers={"content-type": "application/json"}) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if json.loads(line)["type"] == "gradient_step":
                            break  # leave mid-step
            for _ in range(200):  # the server notices the disconnect and the step unwinds
                if service.training_since is None and not service.train_calls:
                    break
                await asyncio.sleep(0.05)
            assert await model.get_step() == 0 and service.store.steps() == [0]
            assert all(torch.equal(p, before[n]) for n, p in lora_weights(service).items())

            result = await remote.train(model, groups, learning_rate=1e-2)  # and it still trains
            assert result.step == 1
    await local.close()
