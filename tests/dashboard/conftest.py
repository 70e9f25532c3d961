"""The dashboard tests' run and servers, built once per test file: a file's tests may add to the run
(the page test trains a third step), and no file may see what another added."""

from __future__ import annotations

import pytest

import art
from art.dashboard.app import create_dashboard_app
from art.serve import create_serve_app
from art.server.thread import ServerThread
from art.service.local import LocalService
from tests.support.dashboard_run import KEY, train_step


@pytest.fixture(scope="module")
async def run(tiny_model_path, tmp_path_factory):
    """Two training steps of dash/tiny, and a val step whose group had a failed rollout and equal
    rewards; the backend stays open so a test can train a third step while the page is open."""
    root = tmp_path_factory.mktemp("runs")
    backend = art.LocalBackend(path=str(root))
    model = art.TrainableModel(name="tiny", project="dash", base_model=str(tiny_model_path))
    await model.register(backend)
    for step in range(2):
        await train_step(model, step)
    tool_turn = [{"role": "user", "content": "Weather?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    await model.log([art.TrajectoryGroup([art.Trajectory(messages_and_choices=tool_turn, reward=0.5) for _ in range(2)],
                                         exceptions=[RuntimeError("the tool crashed")])], split="val")
    yield backend, model, root
    await backend.close()


@pytest.fixture(scope="module")
def dashboard(run):
    with ServerThread(create_dashboard_app(run[2])) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def keyed(run):
    """`art serve --api-key dash-key` over the test's runs, on a loopback port."""
    local = LocalService(str(run[2]))
    with ServerThread(create_serve_app(local, api_key=KEY, watchdog_s=None)) as server:
        yield server.base_url
