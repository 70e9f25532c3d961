"""A training step runs beside the serving engine: a request lands and is answered while the
trainer runs, from the last published step, and the next responses report the new step.

The trainer is held inside its step (after its optimizer step has already written the live
adapter) by a progress callback, so the request provably lands while the trainer runs."""

import asyncio
import threading

import pytest

import art
from tests.support.fakes import rollout

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Say something."}]


async def greedy(model, name: str) -> tuple[int, list[float]]:
    """(the step the response says sampled it, its logprobs) of a short greedy completion."""
    completion = await model.openai_client().chat.completions.create(model=name, messages=MESSAGES, max_tokens=6,
                                                                     temperature=0)
    return completion.model_extra["step"], [entry.logprob for entry in completion.choices[0].logprobs.content]


async def groups_for(model) -> list[art.TrajectoryGroup]:
    return await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, seed=10 * g + i) for i in range(4)) for g in range(2)], pbar_desc=None)


def held_step():
    """A progress callback that holds the training thread after its first optimizer step, and
    the events to wait for it and to let it go."""
    inside, release = threading.Event(), threading.Event()

    def progress(event: dict) -> None:
        inside.set()
        assert release.wait(120), "the test never let the step go on"

    return progress, inside, release


async def test_a_request_is_answered_while_the_trainer_runs(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="tiny", project="overlap", base_model=str(tiny_model_path))
    await model.register(backend)
    assert backend.service.loaded(("overlap", "tiny")).serve_while_training
    try:
        step0, before = await greedy(model, "tiny")
        groups = await groups_for(model)
        progress, inside, release = held_step()
        training = asyncio.ensure_future(backend.train(model, groups, learning_rate=1e-2, progress=progress))
        try:
            assert await asyncio.to_thread(inside.wait, 120)  # the optimizer step has written the live adapter
            during_step, during = await asyncio.wait_for(greedy(model, "tiny"), timeout=60)
            assert not training.done()
        finally:
            release.set()
        result = await training
        after_step, after = await greedy(model, "tiny")
        _, checkpoint = await greedy(model, "tiny@1")
    finally:
        await backend.close()
    assert (step0, during_step, result.step, after_step) == (0, 0, 1, 1)
    assert during == pytest.approx(before, abs=1e-5)  # the published step-0 weights, not the half-trained ones
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-4  # the step changed what is served
    assert after == pytest.approx(checkpoint, abs=1e-5)  # the served weights are the saved step's


async def test_with_serving_while_training_off_a_request_waits_for_the_step(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="tiny", project="paused", base_model=str(tiny_model_path),
                               _internal_config={"serve_while_training": False})
    await model.register(backend)
    assert not backend.service.loaded(("paused", "tiny")).serve_while_training
    try:
        groups = await groups_for(model)
        progress, inside, release = held_step()
        training = asyncio.ensure_future(backend.train(model, groups, learning_rate=1e-2, progress=progress))
        try:
            assert await asyncio.to_thread(inside.wait, 120)
            request = asyncio.ensure_future(greedy(model, "tiny"))
            done, _ = await asyncio.wait([request], timeout=3)
            assert not done  # the engine is paused for the step
        finally:
            release.set()
        await training
        step, _ = await asyncio.wait_for(request, timeout=60)
    finally:
        await backend.close()
    assert step == 1  # it waited, and ran on the new weights


@pytest.mark.skipif(__import__("torch").get_num_threads() < 2, reason="needs two cores to split")
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU's split (on CUDA they share the GPU)")
async def test_on_the_cpu_the_trainer_takes_every_core_while_the_engine_is_idle(tiny_model_path, tmp_path):
    import torch

    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="tiny", project="cores", base_model=str(tiny_model_path))
    await model.register(backend)
    loaded = backend.service.loaded(("cores", "tiny"))
    engine_share, trainer_share = loaded.thread_split
    everything = torch.get_num_threads()
    threads, inside, release = [], threading.Event(), threading.Event()

    def progress(event: dict) -> None:  # in the trainer's thread, after each optimizer step
        threads.append(torch.get_num_threads())
        if len(threads) == 1:
            inside.set()
            assert release.wait(120)

    try:
        groups = await groups_for(model)
        training = asyncio.ensure_future(backend.train(model, groups, learning_rate=1e-2, mini_batches=2,
                                                       progress=progress))
        try:
            assert await asyncio.to_thread(inside.wait, 120)
            sampling = asyncio.ensure_future(model.openai_client().chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=400, extra_body={"ignore_eos": True}))
            while not loaded.engine.running:
                await asyncio.sleep(0.01)
        finally:
            release.set()
        await training
        await sampling
    finally:
        await backend.close()
    assert engine_share + trainer_share == everything and min(engine_share, trainer_share) >= 1
    # The first mini-batch ran with nothing to sample: every core; the second beside a request.
    assert threads == [everything, trainer_share]
