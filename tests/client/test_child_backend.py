"""`LocalBackend(in_process=False)`: the model service in a real child process over loopback HTTP.

Each child imports torch and loads the tiny model (seconds), so one test walks a whole life:
train and serve, a crash mid-step, a restart that resumes, a close. The orphan test kills a
real parent script with SIGKILL."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import art
from art.backends.child import LOG_NAME, ChildService
from art.errors import BackendError
from tests.support.fakes import greedy_logprobs, one_step, rollout

pytestmark = pytest.mark.integration

SRC = Path(__file__).resolve().parents[2] / "src"


def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state, parent pid, ... (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a PID 1 that never reaps)."""
    fields = stat(pid)
    return fields is not None and fields[0] != "Z"


def children() -> set[int]:
    return {int(pid) for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()}


def files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*"))


async def test_a_child_trains_serves_crashes_and_resumes(tiny_model_path, tmp_path):
    # The same step in process, for the layout the child must reproduce.
    async with art.LocalBackend(path=str(tmp_path / "in")) as local:
        model = art.TrainableModel(name="tiny", project="child", base_model=str(tiny_model_path))
        await model.register(local)
        await one_step(model, 0)
    expected = files(tmp_path / "in" / "child" / "models" / "tiny")

    backend = art.LocalBackend(path=str(tmp_path / "out"), in_process=False)
    assert isinstance(backend.service, ChildService) and backend.service.pid is None  # nothing before register
    model = art.TrainableModel(name="tiny", project="child", base_model=str(tiny_model_path))
    await model.register(backend)
    first = backend.service.pid
    assert first is not None and running(first) and int(stat(first)[1]) == os.getpid()
    assert model.inference_base_url == f"{backend.server_url}/v1" and backend.server_url.startswith("http://127.0.0.1:")
    assert len(model.inference_api_key) >= 32  # the child's random key, not a fixed one
    await one_step(model, 0)  # rollouts with the official openai client, straight to the child
    assert await model.get_step() == 1
    run = tmp_path / "out" / "child" / "models" / "tiny"
    assert files(run) == expected
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOG_NAME, "child"]
    served = await greedy_logprobs(model, "tiny")

    # Killed mid-step (after the first of 4 optimizer steps): a clear BackendError, not httpx's.
    async def ranked(i: int) -> art.Trajectory:  # rewards that always differ: the step has work to do
        trajectory = await rollout(model, seed=10 + i)
        trajectory.reward = float(i)
        return trajectory

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(ranked(i) for i in range(4)) for _ in range(2)], pbar_desc=None)

    def kill_at_first_gradient_step(event) -> None:
        if event["type"] == "gradient_step":
            os.kill(first, signal.SIGKILL)

    with pytest.raises(BackendError) as info:
        await backend.train(model, groups, learning_rate=1e-2, epochs=4, progress=kill_at_first_gradient_step)
    assert type(info.value) is BackendError
    message = str(info.value)
    assert f"child process (pid {first}) died (killed by SIGKILL)" in message and "Register the model again" in message
    assert str(tmp_path / "out" / LOG_NAME) in message  # and its last lines
    with pytest.raises(BackendError, match="died"):
        await model.get_step()

    # The next register starts a new child at the latest complete checkpoint, same weights.
    await model.register(backend)
    second = backend.service.pid
    assert second not in (None, first) and not running(first)
    assert await model.get_step() == 1 and await backend.list_checkpoints(model) == [0, 1]
    assert await greedy_logprobs(model, "tiny") == pytest.approx(served, abs=1e-5)
    await one_step(model, 1)
    assert await model.get_step() == 2

    await backend.close()
    assert not running(second)
    assert backend.service.child.process.returncode is not None


def test_kill_9_of_the_parent_leaves_no_child(tmp_path):
    """The parent registers a prompted model (the child starts without loading torch: faster)."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import asyncio, sys
        import art

        async def main():
            backend = art.LocalBackend(path=sys.argv[1], in_process=False)
            await art.Model(name="orphan", project="child").register(backend)  # starts the child
            print(backend.service.pid, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "parent.err", "w") as err:
        parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "root")],
                                  stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        readable, _, _ = select.select([parent.stdout], [], [], 120)
        line = parent.stdout.readline() if readable else b""
        assert line.strip().isdigit(), f"the parent did not start its child:\n{(tmp_path / 'parent.err').read_text()}"
        child = int(line)
        assert running(child) and int(stat(child)[1]) == parent.pid
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while running(child):
            assert time.monotonic() < deadline, f"child {child} outlived its killed parent by 5 s"
            time.sleep(0.05)
        # The child's output went to its log; the parent's stdout held the pid only.
        assert parent.stdout.read() == b""
        assert f"child {child} of {parent.pid}: serving" in (tmp_path / "root" / LOG_NAME).read_text()
    finally:
        parent.kill()
        parent.stdout.close()


async def test_a_child_that_does_not_start_in_time_is_a_clear_error(tmp_path):
    backend = art.LocalBackend(path=str(tmp_path), in_process=False)
    model = art.Model(name="baseline", project="child")
    backend.service.start_timeout = 0.01  # far less than importing the server takes
    before = children()
    with pytest.raises(BackendError) as info:
        await model.register(backend)
    assert "did not answer" in str(info.value) and "starts a child" in str(info.value)  # the log's tail
    assert backend.service.child is None and children() == before  # killed and reaped
    await backend.close()
