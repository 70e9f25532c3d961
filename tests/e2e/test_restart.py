"""Restart safety and retries of `art serve`: `kill -9` in the middle of a step, a restart on the
same path and port, and the client's loop goes on; a train call is never applied twice."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import openai
import pytest

import art
from art.backends.local import LocalBackend
from art.errors import BackendError, StepConflictError
from art.serve import create_serve_app
from art.service.local import LocalService
from tests.support.servers import gather, start_server

KEY = "restart-key-5150"
CHECKPOINT_FILES = {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def complete_checkpoints(root: Path) -> list[int]:
    """The published checkpoint steps; each must hold every file (a rename publishes it whole)."""
    folder = root / "remote" / "models" / "tiny" / "checkpoints"
    steps = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".tmp-"):
            continue  # a write the kill interrupted: never published, removed on the next open
        assert path.name.isdigit(), path
        assert CHECKPOINT_FILES <= {p.name for p in path.iterdir()}, f"incomplete checkpoint {path}"
        steps.append(int(path.name))
    return steps


def kill(process) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


@pytest.mark.integration
async def test_kill_9_mid_step_then_restart_on_the_same_path(tiny_model_path, tmp_path, monkeypatch):
    root, port = tmp_path / "server", free_port()
    monkeypatch.setenv("ART_API_KEY", KEY)
    process, url = start_server(root, tmp_path / "serve1.log", "--port", str(port), env={"ART_API_KEY": KEY},
                                models_dir=tiny_model_path.parent)
    restarted = None
    try:
        async with art.RemoteBackend(url) as backend:
            model = art.TrainableModel(name="tiny", project="remote", base_model=str(tiny_model_path))
            await model.register(backend)
            await model.train(await gather(model, 0), config=art.TrainConfig(learning_rate=1e-2))
            assert await model.get_step() == 1

            # Step 2: the server dies (SIGKILL) as soon as its first optimizer step is reported.
            def on_event(event: dict) -> None:
                if event["type"] == "gradient_step":
                    process.kill()

            groups = await gather(model, 1)
            with pytest.raises(BackendError, match="broke during training"):
                await backend.train(model, groups, learning_rate=1e-2, progress=on_event)
            process.wait(timeout=30)
            on_disk = complete_checkpoints(root)
            assert on_disk[:2] == [0, 1] and len(on_disk) <= 3  # step 2 landed whole or not at all

            restarted, again = start_server(root, tmp_path / "serve2.log", "--port", str(port),
                                            env={"ART_API_KEY": KEY})
            assert again == url
            # A fresh client's rollout names only the model: the server loads the stored run itself.
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
                completion = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Back?"}], max_tokens=3)
            step = await model.get_step()
            assert step == on_disk[-1] == completion.model_extra["step"] and step in (1, 2)

            # The interrupted call sent again: trained now if it had not completed, refused if it had.
            if step == 2:
                with pytest.raises(StepConflictError, match="already at step 2"):
                    await backend.train(model, groups, learning_rate=1e-2)
            else:
                assert (await backend.train(model, groups, learning_rate=1e-2)).step == 2
            # And the loop goes on.
            await model.train(await gather(model, 2), config=art.TrainConfig(learning_rate=1e-2))
            assert await model.get_step() == 3 and complete_checkpoints(root) == [0, 1, 2, 3]
    finally:
        kill(process)
        if restarted is not None:
            kill(restarted)
    for log in ("serve1.log", "serve2.log"):
        assert KEY not in (tmp_path / log).read_text()


class FlakyTransport(httpx.AsyncBaseTransport):
    """The real app in process; `fail` makes the next train call lose its connection, either
    after the server answered ("after", so the step completed) or before it got there ("before")."""

    def __init__(self, app) -> None:
        self.inner = httpx.ASGITransport(app)
        self.fail: str | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        failing = self.fail if request.url.path.endswith("/train") else None
        if failing == "before":
            self.fail = None
            raise httpx.ConnectError("connection refused (test)", request=request)
        response = await self.inner.handle_async_request(request)  # runs the whole step (buffered)
        if failing == "after":
            self.fail = None
            first = (await response.aread()).split(b"\n")[0] + b"\n"

            class Broken(httpx.AsyncByteStream):
                async def __aiter__(self):
                    yield first
                    raise httpx.ReadError("connection reset (test)", request=request)

            return httpx.Response(response.status_code, headers=response.headers, stream=Broken())
        return response


async def test_a_retried_train_call_is_never_applied_twice(tiny_model_path, tmp_path):
    local = LocalService(str(tmp_path))
    transport = FlakyTransport(create_serve_app(local))
    config = art.TrainConfig(learning_rate=1e-2)
    async with art.RemoteBackend("http://testserver", transport=transport) as backend:
        model = art.TrainableModel(name="tiny", project="remote", base_model=str(tiny_model_path))
        await model.register(backend)
        groups = await gather(model, 0)

        transport.fail = "after"  # the step completes, the client never hears of it
        with pytest.raises(BackendError, match="broke during training"):
            await model.train(groups, config=config)
        assert await model.get_step() == 1
        with pytest.raises(StepConflictError, match="already at step 1") as conflict:  # a blind retry
            await model.train(groups, config=config)
        assert (conflict.value.expected_step, conflict.value.current_step) == (0, 1)
        assert await model.get_step() == 1

        await model.train(await gather(model, 1), config=config)  # new groups train as usual
        assert await model.get_step() == 2

        transport.fail = "before"  # lost before the server had it: the retry does train
        groups = await gather(model, 2)
        with pytest.raises(BackendError):
            await model.train(groups, config=config)
        assert await model.get_step() == 2
        await model.train(groups, config=config)
        assert await model.get_step() == 3

        # The raw protocol: a stale expected_step is a 409 naming both steps, and nothing trains.
        client = httpx.AsyncClient(transport=transport, base_url="http://testserver")
        body = {"trajectory_groups": [g.for_logging() for g in groups], "expected_step": 1}
        response = await client.post("/art/models/remote/tiny/train", json=body)
        error = response.json()["error"]
        assert response.status_code == 409 and error["code"] == "step_conflict" and error["param"] == "expected_step"
        assert (error["expected_step"], error["current_step"]) == (1, 3) and "already at step 3" in error["message"]
        await client.aclose()
        assert await model.get_step() == 3
    await local.close()


@pytest.mark.integration
async def test_racing_train_calls_for_the_same_step(tiny_model_path, tmp_path):
    """Both pass the route's early check; the model's training lock lets only one train."""
    backend = LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="race", project="p", base_model=str(tiny_model_path))
    await model.register(backend)
    groups = await gather(model, 0)
    results = await asyncio.gather(*(backend.train(model, groups, learning_rate=1e-2, expected_step=0)
                                     for _ in range(2)), return_exceptions=True)
    assert sorted(type(r).__name__ for r in results) == ["StepConflictError", "TrainResult"]
    assert await model.get_step() == 1
    await backend.close()


async def test_a_name_stored_in_two_projects_is_not_guessed(tmp_path):
    from art.storage.layout import ModelDir

    for project in ("a", "b"):
        ModelDir(tmp_path, project, "same").write_model_json({"name": "same", "project": project, "base_model": "x"})
    local = LocalService(str(tmp_path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(create_serve_app(local)),
                                 base_url="http://testserver") as client:
        response = await client.post("/v1/chat/completions",
                                     json={"model": "same", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 404 and "several projects (a, b)" in response.json()["error"]["message"]
        response = await client.post("/v1/chat/completions",
                                     json={"model": "other", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 404
