"""Data-parallel training (`art.training.data_parallel`): two gloo ranks make the update one
process makes, and a rank that dies mid-step costs that step only."""

from __future__ import annotations

import time

import pytest
import torch

import art
from art.training.data_parallel import Collective, RankPeers, RankSpec
from art.training.options import TrainOptions
from art.training.trainer import Trainer, prepare_batch
from tests.test_trainer_options import groups_of_choices
from tests.test_training_loop import greedy_logprobs, rollout

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}


def tiny_trainer(path, peers=None) -> Trainer:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(task_type="CAUSAL_LM", **LORA))
    return Trainer(model, AutoTokenizer.from_pretrained(path), peers=peers)


def state(trainer: Trainer) -> tuple[dict, dict]:
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    moments = {k: v["exp_avg"].clone() for k, v in trainer.optimizer.state_dict()["state"].items()}
    return weights, moments


def assert_same_updates(expected: list[dict], got: list[dict]) -> None:
    """Each update's metrics as the single process's, within 1e-5; two optimizer steps each."""
    for want, have in zip(expected, got, strict=True):
        for key in ("loss", "policy_loss", "grad_norm", "entropy", "trained_tokens", "tokens_computed"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert have["optimizer_steps"] == 2


def test_shards_cover_the_batch_once_and_balance_tokens():
    groups = groups_of_choices(seed=3, groups=5, samples=4)
    sequences, _, _ = prepare_batch(groups, TrainOptions())
    shards = [Collective(rank, 2).shard(sequences) for rank in range(2)]
    assert sorted(id(s) for shard in shards for s in shard) == sorted(id(s) for s in sequences)
    assert all(len({s.group for s in shard}) >= 2 for shard in shards)  # whole groups, split between ranks
    tokens = [sum(len(s.token_ids) for s in shard) for shard in shards]
    assert abs(tokens[0] - tokens[1]) <= max(sum(len(s.token_ids) for s in sequences if s.group == g) for g in range(5))
    one_group = [s for s in sequences if s.group == 0]  # fewer groups than ranks: single sequences
    assert all(Collective(rank, 2).shard(one_group) for rank in range(2))


def test_two_ranks_make_the_single_process_update(tiny_model_path, tmp_path):
    """Two optimizer steps per update (mini_batches=2) and two updates: the second would differ
    if the peer's weights or optimizer state had drifted from rank 0's."""
    groups = [groups_of_choices(seed=1, groups=4, samples=4), groups_of_choices(seed=2, groups=4, samples=4)]
    options = TrainOptions(learning_rate=1e-3, mini_batches=2, micro_batch_tokens=64, packed_row_tokens=32)
    single = tiny_trainer(tiny_model_path)
    single.save(tmp_path / "start")
    expected = [single.step(batch, options, quiet=True) for batch in groups]

    peers = RankPeers(2, RankSpec(str(tiny_model_path), LORA, "cpu", "float32"))
    parallel = tiny_trainer(tiny_model_path, peers=peers)
    try:
        parallel.restore(tmp_path / "start")  # starts rank 1, which loads the same checkpoint
        assert parallel.collective.world == 2 and peers.healthy
        got = [parallel.step(batch, options, quiet=True) for batch in groups]
    finally:
        peers.close()
    assert_same_updates(expected, got)
    (weights, moments), (want_weights, want_moments) = state(parallel), state(single)
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for key, value in want_moments.items():  # Adam's first moment: a running mean of the gradients
        torch.testing.assert_close(moments[key], value, rtol=1e-5, atol=1e-8, msg=str(key))
    assert len(parallel.last_trainer_logprobs) == len(single.last_trainer_logprobs)  # rank 1's rows gathered


def test_a_peer_that_dies_before_joining_fails_the_start_at_once(tiny_model_path, monkeypatch):
    """A peer that cannot even start (here a malformed ART_RANK_THREADS) would leave rank 0 in
    the group's rendezvous until STEP_TIMEOUT (30 minutes); the start fails as soon as it ends."""
    monkeypatch.setenv("ART_RANK_THREADS", "not-a-number")  # read by the peer only, before it joins
    peers = RankPeers(2, RankSpec(str(tiny_model_path), LORA, "cpu", "float32"))
    started = time.monotonic()
    try:
        with pytest.raises(art.BackendError, match="rank 1 ended .* before joining"):
            peers.start()
    finally:
        peers.close()
    assert time.monotonic() - started < 60 and not peers.healthy


async def rank_groups(model, step: int):
    """Two groups of four rollouts, seeded by `step`."""
    return await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, seed=100 * step + 10 * g + i) for i in range(4)) for g in range(2)],
        pbar_desc=None)


async def kill_a_rank_mid_step_then_train(backend, model, peers, victim: int) -> None:
    """Kill peer process `victim` after the first of two optimizer steps of step 2: the step
    is rolled back (step, checkpoints and served logprobs as before), the peers are started
    again, and the next call trains. The model is at step 1."""
    before = await greedy_logprobs(model, model.name)
    first_pid = peers._processes[victim].pid

    def kill_after_first_optimizer_step(event):
        if event["type"] == "gradient_step" and event["done"] == 1:
            peers._processes[victim].kill()

    with pytest.raises(art.BackendError, match="rolled back"):
        await backend.train(model, await rank_groups(model, 1), learning_rate=1e-2, mini_batches=2,
                            progress=kill_after_first_optimizer_step)
    assert await model.get_step() == 1
    assert await backend.list_checkpoints(model) == [0, 1]  # no half-written step 2
    assert await greedy_logprobs(model, model.name) == pytest.approx(before, abs=1e-6)  # rolled back
    assert peers.healthy and peers._processes[victim].pid != first_pid  # started again at the roll back

    result = await backend.train(model, await rank_groups(model, 1), learning_rate=1e-2, mini_batches=2)
    assert result.step == 2 and result.metrics["optimizer_steps"] == 2
    await backend.close()
    assert not peers._processes


async def test_a_rank_killed_mid_step_costs_that_step_only(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="dp", project="p", base_model=str(tiny_model_path),
                               _internal_config={"trainer_ranks": 2})
    await model.register(backend)
    peers = backend.service.loaded(("p", "dp")).trainer.peers
    result = await backend.train(model, await rank_groups(model, 0), learning_rate=1e-2)
    assert result.step == 1
    await kill_a_rank_mid_step_then_train(backend, model, peers, victim=0)
