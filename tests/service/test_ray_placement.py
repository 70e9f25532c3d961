"""Ray as the cluster layer (`art.ray_cluster`): a local Ray instance places the second engine
replica and the second trainer rank as actors; the loop trains, both replicas serve the new
weights, and a killed actor of either kind costs one step or some requests, not the run; and
`art serve --ray` starts its own local instance."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import art
from art.engine.base import AdapterRef, SamplingParams
from art.engine.router import ReplicaUnavailableError
from art.ray_cluster import RayRanks, RayReplica
from tests.support.fakes import greedy_logprobs, rollout
from tests.support.ranks import rank_groups

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")

SRC = Path(__file__).resolve().parents[2] / "src"


def test_art_serve_with_ray_places_peers_in_ray(tmp_path):
    """`art serve --ray` starts a local Ray instance, says where replicas and ranks go, serves,
    and stops cleanly on SIGTERM. First in this file, before `local_ray` starts the tests' own
    instance (one file runs on one test worker: two local Ray instances never overlap)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("ART_API_KEY", None)
    server = subprocess.Popen([sys.executable, "-m", "art", "serve", "--port", "0", "--path", str(tmp_path), "--ray"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()  # the first line, once Ray is up and the port is bound
        assert "replicas and ranks in ray" in line, line
        url = re.search(r"listening on (\S+)", line).group(1)
        for _ in range(100):
            try:
                assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        else:
            raise AssertionError("the server never answered /health")
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) is not None


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


async def test_replicas_and_ranks_as_ray_actors(local_ray, tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path), placement="ray")
    model = art.TrainableModel(name="ray", project="p", base_model=str(tiny_model_path),
                               _internal_config={"engine_replicas": 2, "trainer_ranks": 2})
    await model.register(backend)
    service = backend.service.loaded(("p", "ray"))
    replica, peers = service.replicas.replicas[1], service.trainer.peers
    assert isinstance(replica, RayReplica) and isinstance(peers.transport, RayRanks) and peers.healthy

    async def groups(step):
        return await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, seed=100 * step + 10 * g + i) for i in range(4)) for g in range(2)],
            pbar_desc=None)

    result = await backend.train(model, await groups(0), learning_rate=1e-2, mini_batches=2)
    assert result.step == 1 and result.metrics["optimizer_steps"] == 2 and result.metrics["replicas_serving"] == 2
    prompt = service.tokenizer.apply_chat_template([{"role": "user", "content": "Fixed."}], add_generation_prompt=True,
                                                   tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    served = [(await r.generate(prompt, params, AdapterRef("ray", None, None)))[0] for r in service.replicas.replicas]
    assert [c.step for c in served] == [1, 1] and served[0].token_ids == served[1].token_ids
    assert served[1].logprobs == pytest.approx(served[0].logprobs, abs=1e-4)

    # The rank actor dies after the first of two optimizer steps: that step rolls back, the next trains.
    before = await greedy_logprobs(model, "ray")
    first_rank = list(peers.transport.pids)

    def kill_rank(event):
        if event["type"] == "gradient_step" and event["done"] == 1:
            ray.kill(peers.transport.actors[0])

    with pytest.raises(art.BackendError, match="rolled back"):
        await backend.train(model, await groups(1), learning_rate=1e-2, mini_batches=2, progress=kill_rank)
    assert await model.get_step() == 1 and await backend.list_checkpoints(model) == [0, 1]
    assert await greedy_logprobs(model, "ray") == pytest.approx(before, abs=1e-6)
    assert peers.healthy and peers.transport.pids != first_rank
    assert (await backend.train(model, await groups(1), learning_rate=1e-2, mini_batches=2)).step == 2

    # The replica actor dies: a request it holds fails with a retryable 503; restart brings it back.
    ray.kill(replica.actor)
    with pytest.raises(ReplicaUnavailableError):
        await replica.generate(prompt, params, AdapterRef("ray", None, None))
    client = model.openai_client()
    answers = await asyncio.gather(*(client.chat.completions.create(
        model="ray", messages=[{"role": "user", "content": f"After {n}."}], max_tokens=3) for n in range(4)))
    assert {a.model_extra["replica"] for a in answers} == {0}
    assert await backend.restart_replicas(model) == [1]
    again = (await replica.generate(prompt, params, AdapterRef("ray", None, None)))[0]
    assert again.step == 2 and again.replica == 1
    await backend.close()
    assert not peers.transport.actors and replica.actor is None


async def test_sharded_ranks_as_ray_actors(local_ray, tiny_model_path, tmp_path):
    """fsdp with placement "ray": both ranks are actors (the backend holds the served copy);
    the step trains, the probe passes on the ranks' shards, and a rank actor killed between
    steps costs the next call only."""
    backend = art.LocalBackend(path=str(tmp_path), placement="ray")
    model = art.TrainableModel(name="fsdp", project="p", base_model=str(tiny_model_path),
                               _internal_config={"full_finetune": True, "trainer_ranks": 2, "fsdp": True})
    await model.register(backend)
    peers = backend.service.loaded(("p", "fsdp")).trainer.peers
    assert isinstance(peers.transport, RayRanks) and len(peers.transport.pids) == 2

    before = await greedy_logprobs(model, "fsdp")
    events: list = []
    result = await backend.train(model, await rank_groups(model, 0), learning_rate=1e-2, mini_batches=2,
                                 progress=events.append)
    assert result.step == 1 and result.metrics["weight_sync_max_abs_diff"] <= 1e-4
    assert [e["done"] for e in events if e["type"] == "gradient_step"] == [1, 2]  # rank 0's progress came back
    trained = await greedy_logprobs(model, "fsdp")
    assert max(abs(a - b) for a, b in zip(trained, before)) > 1e-3

    ray.kill(peers.transport.actors[1])
    with pytest.raises(art.BackendError, match="rolled back"):
        await backend.train(model, await rank_groups(model, 1), learning_rate=1e-2)
    assert await model.get_step() == 1 and await backend.list_checkpoints(model) == [0, 1]
    assert await greedy_logprobs(model, "fsdp") == pytest.approx(trained, abs=1e-6)
    assert (await backend.train(model, await rank_groups(model, 1), learning_rate=1e-2)).step == 2
    await backend.close()
    assert not peers.transport.actors
