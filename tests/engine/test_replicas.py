"""Engine replicas (`art.engine.replicas`): routing with prefix affinity, every replica on the
trained weights after a step, and a replica that dies mid-rollout."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

import art
from art.devices import device_for, use_device
from art.engine.base import AdapterRef, SamplingParams
from art.engine.replica_process import ReplicaSpec
from art.engine.replicas import ReplicaSet
from art.engine.router import BALANCE, PrefixRouter, Replica, ReplicaUnavailableError
from art.errors import BackendUnavailableError
from art.service.probe import PROBE_TOKENS

SYSTEM = list(range(1000, 1040))  # a chat template's common head: every prompt starts with it


class FakeReplica(Replica):
    """A replica as the router sees it, and nothing more."""

    step = None

    def __init__(self, index: int) -> None:
        self.index = index


def fake(index: int) -> Replica:
    return FakeReplica(index)


def test_a_groups_requests_stay_on_one_replica_and_groups_spread():
    router, replicas = PrefixRouter(), [fake(0), fake(1)]
    chosen = []
    for group in range(4):
        prompt = SYSTEM + [group] * 20
        for _ in range(8):  # a group's samples arrive together: each stays in flight
            replica = router.choose(replicas, prompt)
            replica.in_flight += 1
            chosen.append((group, replica.index))
    by_group = {g: {i for gg, i in chosen if gg == g} for g in range(4)}
    assert all(len(indices) == 1 for indices in by_group.values()), by_group
    assert {next(iter(i)) for i in by_group.values()} == {0, 1}  # both replicas get groups

    # The next turn of a conversation (its prompt extends an earlier one) follows it too.
    replicas[0].in_flight = replicas[1].in_flight = 0
    first = router.choose(replicas, SYSTEM + [7] * 40)
    assert router.choose(replicas, SYSTEM + [7] * 40 + [8] * 30).index == first.index


def test_affinity_yields_to_load_and_dead_replicas_get_nothing():
    router, replicas = PrefixRouter(), [fake(0), fake(1)]
    prompt = SYSTEM + [5] * 20
    home = router.choose(replicas, prompt)
    home.in_flight = BALANCE  # far busier than the other
    assert router.choose(replicas, prompt).index != home.index
    home.in_flight, home.down = 0, "its process stopped"
    assert {router.choose(replicas, SYSTEM + [n]).index for n in range(6)} == {1 - home.index}
    replicas[1 - home.index].down = "failed the weight-sync probe"
    with pytest.raises(ReplicaUnavailableError):
        router.choose(replicas, prompt)


def test_each_replica_gets_a_gpu_of_its_own_and_more_replicas_than_gpus_are_refused(monkeypatch):
    assert [device_for("cpu", i, 0, "engine_replicas") for i in range(3)] == ["cpu"] * 3
    assert [device_for("cuda", i, 4, "engine_replicas") for i in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [device_for("cuda:2", i, 4, "engine_replicas") for i in range(4)] == ["cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    with pytest.raises(art.ArtValueError, match="engine_replicas=3 needs a GPU per replica") as error:
        device_for("cuda:1", 2, 2, "engine_replicas")  # not a second replica on a GPU that already serves one
    assert error.value.field == "engine_replicas" and "this machine has 2" in str(error.value)

    # The set refuses before it starts any process, as RankPeers.start does for trainer_ranks.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    engine = SimpleNamespace(tokenizer=None, max_model_len=64, grammars=None)
    spec = ReplicaSpec("model", None, SimpleNamespace(device="cuda:0"))
    with pytest.raises(art.ArtValueError, match="engine_replicas=2 needs a GPU per replica; this machine has 1"):
        ReplicaSet(engine, spec, 2)
    assert len(ReplicaSet(engine, spec, 1).replicas) == 1
    assert len(ReplicaSet(engine, ReplicaSpec("model", None, SimpleNamespace(device="cpu")), 3).replicas) == 3

    chosen: list = []  # a replica process makes its GPU current before it builds anything
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    use_device("cpu")
    use_device("cuda:1")
    assert chosen == [torch.device("cuda:1")]


async def ask(client, prompt: str, max_tokens: int = 4, **kwargs):
    return await client.chat.completions.create(
        model="rep", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, **kwargs)


@pytest.mark.integration
async def test_two_replicas_serve_train_and_survive_a_kill(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="rep", project="p", base_model=str(tiny_model_path),
                               _internal_config={"engine_replicas": 2})
    await model.register(backend)
    service = backend.service.loaded(("p", "rep"))
    client = model.openai_client()

    group = await asyncio.gather(*(ask(client, "The same prompt for a whole group.", seed=i) for i in range(8)))
    assert len({c.model_extra["replica"] for c in group}) == 1  # one group, one replica (its prefix cached)
    spread = await asyncio.gather(*(ask(client, f"Prompt number {n} of many, each its own.") for n in range(12)))
    assert {c.model_extra["replica"] for c in spread} == {0, 1}

    trajectories = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, c.choices[0]],
                                   reward=float(i % 2)) for i, c in enumerate(group)]
    result = await backend.train(model, [art.TrajectoryGroup(trajectories)], learning_rate=5e-2)
    assert result.step == 1 and result.metrics["replicas_serving"] == 2
    assert result.metrics["weight_sync_max_abs_diff"] < 1e-3
    # Both replicas now hold step 1: the same greedy logprobs for a fixed prompt, labelled step 1.
    prompt = service.tokenizer.apply_chat_template([{"role": "user", "content": "Fixed."}], add_generation_prompt=True,
                                                   tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    served = [(await replica.generate(prompt, params, AdapterRef("rep", None, None)))[0]
              for replica in service.replicas.replicas]
    assert [c.step for c in served] == [1, 1] and [c.replica for c in served] == [0, 1]
    assert served[0].token_ids == served[1].token_ids
    assert served[1].logprobs == pytest.approx(served[0].logprobs, abs=1e-4)
    # Streamed, each replica (replica 1 across its pipe) sends every token as its own item, then
    # the same completion.
    for replica, alone in zip(service.replicas.replicas, served):
        *sampled, (whole,) = [item async for item in replica.stream(prompt, params, AdapterRef("rep", None, None))]
        assert [t.token_ids for t in sampled] == [[i] for i in alone.token_ids]
        assert {t.replica for t in sampled} == {replica.index} and whole.token_ids == alone.token_ids

    # Kill replica 1 while a rollout is in flight: its requests fail with a retryable 503,
    # the others are served, new requests go to replica 0, and /health says why.
    peer = service.replicas.replicas[1]
    pending = [asyncio.ensure_future(ask(client, f"Slow prompt {n}.", max_tokens=120, extra_body={"ignore_eos": True}))
               for n in range(8)]
    for _ in range(2000):  # until replica 1 has some of them (bounded: a routing bug fails, not hangs)
        if peer.in_flight:
            break
        await asyncio.sleep(0.005)
    assert peer.in_flight, [r.in_flight for r in service.replicas.replicas]
    peer._process.kill()
    outcomes = await asyncio.gather(*pending, return_exceptions=True)
    failed = [o for o in outcomes if isinstance(o, Exception)]
    assert failed and all(isinstance(o, openai.APIStatusError) and o.status_code == 503 for o in failed)
    assert all(o.response.headers["retry-after"] == "1" for o in failed)
    assert all(o.model_extra["replica"] == 0 for o in outcomes if not isinstance(o, Exception))
    after = await asyncio.gather(*(ask(client, f"After the kill {n}.") for n in range(6)))
    assert {c.model_extra["replica"] for c in after} == {0}
    base = model.inference_base_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base) as http:
        health = (await http.get("/health")).json()
        assert health["status"] == "degraded"
        assert health["replicas_down"][0]["replica"] == 1 and "stopped" in health["replicas_down"][0]["down"]

        assert await backend.restart_replicas(model) == [1]
        assert (await http.get("/health")).json()["status"] == "ok"
    again = [(await replica.generate(prompt, params, AdapterRef("rep", None, None)))[0]
             for replica in service.replicas.replicas]
    assert [c.step for c in again] == [1, 1]
    assert again[1].logprobs == pytest.approx(served[0].logprobs, abs=1e-4)  # restarted on step 1's weights

    # Closed while serving (the backend shutting down): its requests fail as retryable, none hangs.
    slow = SamplingParams(max_tokens=200, ignore_eos=True)
    pending = asyncio.ensure_future(peer.generate(prompt, slow, None))
    streamed = peer.stream(prompt, slow, None)
    await anext(streamed)  # both requests are in flight now
    await asyncio.to_thread(peer.close)
    with pytest.raises(BackendUnavailableError) as closed:
        async for _ in streamed:
            pass
    assert closed.value.retry_after == 1
    with pytest.raises(BackendUnavailableError):
        await pending
    await backend.close()


@pytest.mark.integration
async def test_dedicated_samplers_leave_the_trainers_engine_idle(tiny_model_path, tmp_path):
    """`dedicated_samplers`: replica 1 answers everything, including while a step trains and right
    after it (on the new weights); replica 0 stands in only when replica 1 is down."""
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="rep", project="p", base_model=str(tiny_model_path),
                               _internal_config={"engine_replicas": 2, "dedicated_samplers": True})
    await model.register(backend)
    service = backend.service.loaded(("p", "rep"))
    client = model.openai_client()

    group = await asyncio.gather(*(ask(client, f"Prompt {n}, each its own.", seed=n) for n in range(8)))
    assert {c.model_extra["replica"] for c in group} == {1}
    trajectories = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, c.choices[0]],
                                   reward=float(i % 2)) for i, c in enumerate(group)]
    training = asyncio.ensure_future(backend.train(model, [art.TrajectoryGroup(trajectories)], learning_rate=5e-2))
    during = []
    while not training.done():  # requests sent while the step trains and publishes
        during.append(await ask(client, "While it trains.", max_tokens=4))
    assert (await training).step == 1
    assert during and {c.model_extra["replica"] for c in during} == {1}
    assert {c.model_extra["step"] for c in during} <= {0, 1}
    after = await asyncio.gather(*(ask(client, f"After step one {n}.") for n in range(4)))
    assert {(c.model_extra["replica"], c.model_extra["step"]) for c in after} == {(1, 1)}
    assert service.engine.steps <= PROBE_TOKENS  # replica 0 decoded the weight-sync probe, no user's request

    service.replicas.replicas[1]._process.kill()
    for _ in range(200):  # until the set has noticed the dead process
        if service.replicas.replicas[1].down:
            break
        await asyncio.sleep(0.05)
    stand_in = await ask(client, "With replica 1 down.")
    assert (stand_in.model_extra["replica"], stand_in.model_extra["step"]) == (0, 1)
    await backend.close()


def test_dedicated_samplers_need_replicas_to_sample():
    from art.service.settings import parse_internal_config

    assert parse_internal_config({"engine_replicas": 2, "dedicated_samplers": True}).dedicated_samplers
    assert not parse_internal_config({"engine_replicas": 2}).dedicated_samplers
    for bad in ({"dedicated_samplers": True}, {"engine_replicas": 2, "dedicated_samplers": "yes"}):
        with pytest.raises(art.ArtValueError) as info:
            parse_internal_config(bad)
        assert info.value.field == "dedicated_samplers"
