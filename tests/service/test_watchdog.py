"""The server's watchdog, for real: a stuck engine loop and a stuck training step (the test holds
the model lock they need) are reported in the log with the stuck thread's stack and on /health,
and cleared when they move again. The app runs in this process over a real loopback socket."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import pytest

import art
from art.serve import create_serve_app
from art.server.thread import ServerThread
from art.service.local import LocalService

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Say something."}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_for_health(client: httpx.AsyncClient, status: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = (await client.get("/health")).json()
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, f"/health never became {status!r}: {body}"
        await asyncio.sleep(0.05)


async def wait_for_warnings(caplog, count: int, timeout: float = 10.0) -> list[logging.LogRecord]:
    """The watchdog's WARNING lines so far, once there are `count` of them (each logged while
    the thread is still stuck, so its stack shows where)."""
    deadline = time.monotonic() + timeout
    while True:
        records = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "art.service.watchdog"]
        if len(records) >= count:
            return records
        assert time.monotonic() < deadline, f"the watchdog logged {len(records)} warnings, not {count}"
        await asyncio.sleep(0.05)


async def test_stuck_engine_and_training_step_are_reported(tiny_model_path, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="art.service.watchdog")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    local = LocalService(str(tmp_path))
    app = create_serve_app(local, watchdog_s=0.5, watchdog_train_s=0.5)
    with ServerThread(app, port=port):  # its lifespan runs the watchdog thread
        async with art.RemoteBackend(url) as remote, httpx.AsyncClient(base_url=url) as client:
            model = art.TrainableModel(name="dog", project="p", base_model=str(tiny_model_path))
            await model.register(remote)
            service = local.loaded(("p", "dog"))
            health = await wait_for_health(client, "ok")
            assert health["stuck"] == []

            # A rollout whose engine loop cannot get the model lock.
            service.lock.acquire()
            try:
                request = asyncio.create_task(model.openai_client().chat.completions.create(
                    model="dog", messages=MESSAGES, max_tokens=3))
                health = await wait_for_health(client, "degraded")
                (stuck,) = health["stuck"]
                assert stuck["what"] == "engine" and stuck["model"] == "p/dog"
                assert stuck["for_s"] >= 0.5 and stuck["limit_s"] == 0.5
                assert "art/engine/llm_engine.py:" in stuck["where"] and stuck["where"].endswith(" in step")
                assert not request.done()
                engine_log = (await wait_for_warnings(caplog, 1))[0].getMessage()
            finally:
                service.lock.release()
            completion = await request
            assert completion.choices[0].message.content is not None
            await wait_for_health(client, "ok")

            # A training step that cannot get the model lock (the engine itself is idle).
            completion = await model.openai_client().chat.completions.create(
                model="dog", messages=MESSAGES, max_tokens=4, seed=1)
            group = art.TrajectoryGroup([
                art.Trajectory(messages_and_choices=[*MESSAGES, completion.choices[0]], reward=r) for r in (0.0, 1.0)])
            service.lock.acquire()
            try:
                training = asyncio.create_task(remote.train(model, [group], learning_rate=1e-2))
                health = await wait_for_health(client, "degraded")
                (stuck,) = health["stuck"]
                assert stuck["what"] == "training step" and stuck["model"] == "p/dog"
                # The step waits at its start, where the engine's served copy of the weights is taken.
                assert "art/engine/llm_engine.py:" in stuck["where"]
                assert stuck["where"].endswith(" in serving_while_training")
                assert any("service/update.py" in frame and "_step" in frame for frame in stuck["stack"])
                warnings = await wait_for_warnings(caplog, 2)
            finally:
                service.lock.release()
            assert (await training).step == 1
            await wait_for_health(client, "ok")

    assert [r.getMessage().split(" has been stuck")[0] for r in warnings] == [
        "watchdog: the engine of p/dog", "watchdog: the training step of p/dog"]
    assert "in _loop" in engine_log and "with self.lock" in engine_log  # the stack, source lines included
    assert "in serving_while_training" in warnings[1].getMessage() and "in _step" in warnings[1].getMessage()
    assert sum("moving again" in r.getMessage() for r in caplog.records) == 2
