"""Checkpoint forks (B starts from A's checkpoint), locally and over a loopback `art serve` app;
trajectories uploaded once per step; `TrajectoryGroup.__len__`; no module shadowed by a name."""

from __future__ import annotations

import asyncio
import importlib
import json
import pkgutil
import types
from pathlib import Path

import httpx
import pytest

import art
from art.errors import ArtValueError
from art.serve import create_serve_app
from art.server.thread import ServerThread
from art.service.local import LocalService
from art.storage.checkpoints import CheckpointStore
from art.storage.fork import copy_checkpoint, plan_fork
from art.storage.layout import ModelDir
from tests.support.fakes import greedy_logprobs, one_step


def run_dir(root: Path, project: str, name: str) -> Path:
    return root / project / "models" / name


def checkpoint_steps(root: Path, project: str, name: str) -> list[str]:
    return sorted(p.name for p in (run_dir(root, project, name) / "checkpoints").iterdir())


# -- the plan and the copy, on disk ---------------------------------------------------------


def fake_run(root: Path, project: str, name: str, steps: list[int], base_model: str = "base") -> None:
    ModelDir(root, project, name).write_model_json({"base_model": base_model})
    for step in steps:
        folder = run_dir(root, project, name) / "checkpoints" / f"{step:04d}"
        folder.mkdir(parents=True)
        (folder / "weights.bin").write_bytes(bytes([step]) * 8)


def test_plan_picks_the_last_step_not_after_and_names_bad_fields(tmp_path):
    fake_run(tmp_path, "p", "a", [0, 2, 5])
    pick = {n: plan_fork(tmp_path, ("p", "a"), ("p", "b"), base_model="base", not_after_step=n).step
            for n in (None, 5, 4, 2, 1)}
    assert pick == {None: 5, 5: 5, 4: 2, 2: 2, 1: 0}
    fake_run(tmp_path, "q", "late", [3])
    cases = [(("q", "late"), {"not_after_step": 2}, "not_after_step"),
             (("p", "missing"), {}, "from_model"),
             (("p", "a"), {"base_model": "other"}, "base_model"),
             (("p", "b"), {}, "from_model"),  # into itself
             (("p", "a"), {"not_after_step": -1}, "not_after_step")]
    for source, kwargs, field in cases:
        with pytest.raises(ArtValueError) as caught:
            plan_fork(tmp_path, source, ("p", "b"), **{"base_model": "base", **kwargs})
        assert caught.value.field == field, (source, kwargs, str(caught.value))
    assert not run_dir(tmp_path, "p", "b").exists()  # nothing written by a refused plan

    fake_run(tmp_path, "p", "trained", [0, 1])
    with pytest.raises(ArtValueError, match=r"trained checkpoints \[1\]") as caught:
        plan_fork(tmp_path, ("p", "a"), ("p", "trained"), base_model="base")
    assert caught.value.field == "model"


def test_a_failed_copy_leaves_the_target_unchanged(tmp_path):
    fake_run(tmp_path, "p", "a", [0, 3])
    fake_run(tmp_path, "p", "b", [0])
    plan = plan_fork(tmp_path, ("p", "a"), ("p", "b"), base_model="base")
    store = CheckpointStore(run_dir(tmp_path, "p", "b") / "checkpoints")
    for file in (run_dir(tmp_path, "p", "a") / "checkpoints" / "0003").iterdir():
        file.unlink()
    (run_dir(tmp_path, "p", "a") / "checkpoints" / "0003").rmdir()  # the source vanishes mid-fork
    with pytest.raises(OSError):
        copy_checkpoint(plan, store)
    assert checkpoint_steps(tmp_path, "p", "b") == ["0000"]  # no step 3, no temp folder
    # Replacing step 0 in place: the new folder appears whole, the old one is gone.
    plan0 = plan_fork(tmp_path, ("p", "a"), ("p", "b"), base_model="base", not_after_step=0)
    (run_dir(tmp_path, "p", "a") / "checkpoints" / "0000" / "weights.bin").write_bytes(b"from a")
    copy_checkpoint(plan0, store)
    assert checkpoint_steps(tmp_path, "p", "b") == ["0000"]
    assert (run_dir(tmp_path, "p", "b") / "checkpoints" / "0000" / "weights.bin").read_bytes() == b"from a"


# -- locally: LocalBackend ------------------------------------------------------------------


@pytest.mark.integration
async def test_fork_serves_the_source_step_locally(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    a = art.TrainableModel(name="a", project="runs", base_model=str(tiny_model_path))
    await a.register(backend)
    for step in range(2):
        await one_step(a, step)
    a_at = {s: await greedy_logprobs(a, f"a@{s}") for s in (1, 2)}
    assert max(abs(x - y) for x, y in zip(a_at[1], a_at[2])) > 1e-4  # the steps differ: the test can fail

    # B registered first (ART's newer order): it serves its own fresh step 0 until the fork.
    b = art.TrainableModel(name="b", project="forks", base_model=str(tiny_model_path))
    await b.register(backend)
    fresh = await greedy_logprobs(b, "b")
    assert max(abs(x - y) for x, y in zip(fresh, a_at[1])) > 1e-4

    # A source checkpoint that does not load is refused and B keeps its step, files and weights.
    fake_run(tmp_path, "runs", "broken", [1], base_model=str(tiny_model_path))
    with pytest.raises(ArtValueError) as caught:
        await backend.fork_checkpoint(b, "broken", "runs")
    assert caught.value.field == "from_model"
    assert await b.get_step() == 0 and checkpoint_steps(tmp_path, "forks", "b") == ["0000"]
    assert await greedy_logprobs(b, "b") == pytest.approx(fresh, abs=1e-6)

    await backend._experimental_fork_checkpoint(b, from_model="a", from_project="runs", not_after_step=1)
    assert await b.get_step() == 1
    assert await greedy_logprobs(b, "b") == pytest.approx(a_at[1], abs=1e-5)  # B's first served logprobs
    assert checkpoint_steps(tmp_path, "forks", "b") == ["0001"]  # B's untrained step 0 is gone
    record = json.loads((run_dir(tmp_path, "forks", "b") / "model.json").read_text())["forked_from"]
    assert {k: record[k] for k in ("project", "name", "step")} == {"project": "runs", "name": "a", "step": 1}

    await one_step(b, 1)  # B trains on from there; the record stays
    assert await b.get_step() == 2
    assert json.loads((run_dir(tmp_path, "forks", "b") / "model.json").read_text())["forked_from"] == record
    assert await backend.fork_checkpoint(b, "a", "runs", not_after_step=1) == 2  # the same fork again: no-op
    with pytest.raises(ArtValueError) as caught:
        await backend.fork_checkpoint(b, "a", "runs")  # another step into a trained B
    assert caught.value.field == "model"
    other = art.TrainableModel(name="c", project="forks", base_model="some/other-model")
    with pytest.raises(ArtValueError) as caught:
        await backend.fork_checkpoint(other, "a", "runs")
    assert caught.value.field == "base_model" and not run_dir(tmp_path, "forks", "c").exists()

    # Forked before registering (ART's older order): registering loads the forked step.
    d = art.TrainableModel(name="d", project="forks", base_model=str(tiny_model_path))
    assert await backend.fork_checkpoint(d, "a", "runs") == 2
    await d.register(backend)
    assert await d.get_step() == 2
    assert await greedy_logprobs(d, "d") == pytest.approx(a_at[2], abs=1e-5)
    assert json.loads((run_dir(tmp_path, "forks", "d") / "model.json").read_text())["forked_from"]["step"] == 2
    await backend.close()


# -- over a real loopback server ------------------------------------------------------------


class CountingTransport(httpx.AsyncHTTPTransport):
    """The real network transport; remembers each request's path and body."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, bytes]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, await request.aread()))
        return await super().handle_async_request(request)


@pytest.mark.integration
async def test_fork_and_single_upload_over_art_serve(tiny_model_path, tmp_path):
    local = LocalService(tmp_path / "server")
    with ServerThread(create_serve_app(local)) as server:
        transport = CountingTransport()
        async with art.RemoteBackend(server.base_url, transport=transport) as backend:
            a = art.TrainableModel(name="a", project="runs", base_model=str(tiny_model_path))
            await a.register(backend)
            transport.sent.clear()
            await one_step(a, 0)  # model.train: train, then log the train split
            art_calls = [(path, body) for path, body in transport.sent if path.startswith("/art/")]
            carrying = [path for path, body in art_calls if b"token_ids" in body]
            assert carrying == ["/art/models/runs/a/train"]  # the trajectories travelled once
            (log_body,) = [body for path, body in art_calls if path.endswith("/log")]
            assert len(log_body) < 2000 and b"trajectory_groups_from" in log_body
            logged = (run_dir(tmp_path / "server", "runs", "a") / "trajectories" / "train" / "0000.jsonl")
            rows = [json.loads(line) for line in logged.read_text().splitlines()]
            assert len(rows) == 8 and all(r["messages_and_choices"][1]["token_ids"] for r in rows)
            async with httpx.AsyncClient(base_url=server.base_url) as client:  # an id the server does not hold
                answer = await client.post("/art/models/runs/a/log", json={
                    "split": "val", "step": 1, "trajectory_groups_from": "0" * 64})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "trajectory_groups_from"
            a_at_1 = await greedy_logprobs(a, "a@1")

            b = art.TrainableModel(name="b", project="forks", base_model=str(tiny_model_path))
            await b.register(backend)
            assert max(abs(x - y) for x, y in zip(await greedy_logprobs(b, "b"), a_at_1)) > 1e-4
            await backend._experimental_fork_checkpoint(b, from_model="a", from_project="runs")
            assert await b.get_step() == 1
            assert await greedy_logprobs(b, "b") == pytest.approx(a_at_1, abs=1e-5)
            await one_step(b, 1)  # the client expects step 1 now: no step conflict
            assert await b.get_step() == 2

            c = art.TrainableModel(name="c", project="forks", base_model=str(tiny_model_path))
            for kwargs, field in [({"from_model": "missing"}, "from_model"),
                                  ({"from_model": "a", "not_after_step": 99, "from_project": "nope"}, "from_model"),
                                  ({"from_model": "a", "from_s3_bucket": "bucket"}, "from_s3_bucket")]:
                with pytest.raises(ArtValueError) as caught:
                    await backend._experimental_fork_checkpoint(c, **kwargs)
                assert caught.value.field == field
            async with httpx.AsyncClient(base_url=server.base_url) as client:
                answer = await client.post("/art/models/forks/c/fork", json={
                    "from_model": "a", "from_project": "runs", "base_model": "other/model"})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "base_model"
            assert not run_dir(tmp_path / "server", "forks", "c").exists()
        await local.close()


# -- small fixes ------------------------------------------------------------------------------


async def test_group_len_counts_every_rollout_as_art_does():
    async def rollout(reward: float) -> art.Trajectory:
        await asyncio.sleep(0)
        if reward < 0:
            raise ValueError("failed rollout")
        return art.Trajectory(reward=reward)

    group = art.TrajectoryGroup([rollout(1.0), rollout(-1.0), art.Trajectory(reward=0.5)])
    assert len(group) == 3  # before it runs: every rollout given (ART's _num_trajectories)
    await group
    assert len(group) == 2 and len(group.exceptions) == 1  # afterwards: the trajectories
    assert len(art.TrajectoryGroup([art.Trajectory(reward=1.0)])) == 1


def test_no_module_is_shadowed_by_a_name():
    """`package.x` is the module `package/x.py` wherever both exist, except where ART's own
    import paths have both (`from art.utils.iterate_dataset import ...` next to the function
    `art.utils.iterate_dataset`, and `art.mcp.generate_scenarios` likewise)."""
    arts_own = {("art.rewards", "ruler"), ("art.utils", "iterate_dataset"), ("art.utils", "limit_concurrency"),
                ("art.utils.benchmarking", "load_trajectories"), ("art.mcp", "generate_scenarios")}
    packages = [art] + [importlib.import_module(info.name)
                        for info in pkgutil.walk_packages(art.__path__, "art.") if info.ispkg]
    shadowed = []
    for package in packages:
        for info in pkgutil.iter_modules(package.__path__):
            value = vars(package).get(info.name)
            is_module = isinstance(value, types.ModuleType) and value.__name__ == f"{package.__name__}.{info.name}"
            if value is not None and not is_module and (package.__name__, info.name) not in arts_own:
                shadowed.append(f"{package.__name__}.{info.name}")
    assert shadowed == []
    assert art.retry is art.utils.retry and callable(art.retry)
    assert importlib.import_module("art._retry").retry is art.retry
