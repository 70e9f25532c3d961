"""64 concurrent chat requests through the `art serve` app (real loopback socket, the official
`AsyncOpenAI` client) while a training step runs: every one succeeds, and the `step` each
response reports is the step whose weights sampled it (its logprobs match that step's)."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest

import art
from art.serve import create_serve_app
from art.server.thread import ServerThread
from art.service import probe
from art.service.local import LocalService
from tests.support.devices import DEVICES

pytestmark = pytest.mark.integration

PROMPTS = [f"Count to {i}." for i in range(8)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def ask(client: openai.AsyncOpenAI, model: str, prompt: str):
    return await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0)


@pytest.mark.parametrize("device", DEVICES)
async def test_64_requests_during_a_training_step(tiny_model_path, tmp_path, device):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    local = LocalService(str(tmp_path))
    with ServerThread(create_serve_app(local), port=port):
        async with art.RemoteBackend(url) as remote:
            model = art.TrainableModel(name="busy", project="p", base_model=str(tiny_model_path),
                                       _internal_config={"engine_args": {"device": device}})
            await model.register(remote)
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            pick = [{"role": "user", "content": "Pick."}]
            samples = await asyncio.gather(*(client.chat.completions.create(
                model="busy", messages=pick, max_tokens=4, seed=s) for s in range(4)))
            group = art.TrajectoryGroup([
                art.Trajectory(messages_and_choices=[*pick, c.choices[0]], reward=float(i % 2))
                for i, c in enumerate(samples)])

            accepted = asyncio.Event()
            training = asyncio.create_task(remote.train(
                model, [group], learning_rate=1.0,
                progress=lambda event: accepted.set() if event["type"] == "accepted" else None))
            first = [asyncio.create_task(ask(client, "busy", PROMPTS[i % 8])) for i in range(32)]
            await accepted.wait()  # the rest arrive while the step is being trained (the engine paused)
            second = [asyncio.create_task(ask(client, "busy", PROMPTS[i % 8])) for i in range(32, 64)]
            responses = await asyncio.gather(*first, *second)
            result = await training
            assert result.step == 1

            # What each step's weights answer, asked by name@step once the step is done.
            reference = {(step, prompt): await ask(client, f"busy@{step}", prompt)
                         for step in (0, 1) for prompt in PROMPTS}
            await client.close()
    await local.close()

    assert len(responses) == 64
    steps = [r.model_extra["step"] for r in responses]
    assert set(steps) <= {0, 1}, steps
    differ = max(abs(a.logprob - b.logprob) for prompt in PROMPTS for a, b in zip(
        reference[(0, prompt)].choices[0].logprobs.content, reference[(1, prompt)].choices[0].logprobs.content))
    assert differ > 1e-2, "the step did not change the served logprobs enough to tell the steps apart"
    for i, (response, step) in enumerate(zip(responses, steps)):
        expected = reference[(step, PROMPTS[i % 8])].choices[0]
        got = response.choices[0]
        if device == "cpu":
            assert got.model_extra["token_ids"] == expected.model_extra["token_ids"], (i, step)
            assert [e.logprob for e in got.logprobs.content] == pytest.approx(
                [e.logprob for e in expected.logprobs.content], abs=1e-4), (i, step)
        else:  # bf16: batches of other shapes round differently; the first token's context is the same
            assert abs(got.logprobs.content[0].logprob - expected.logprobs.content[0].logprob) <= \
                probe.HALF_TOLERANCE, (i, step)
