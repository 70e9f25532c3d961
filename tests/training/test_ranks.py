"""Data-parallel training (`art.training.ranks`, `art.training.rank_group`, `art.training.rank_trainers`):
two gloo ranks make the update one process makes, and a rank that dies mid-step costs that step only."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

import art
from art.training.batch import prepare_batch
from art.training.collective import Collective, PeerLost, host_store, start_group
from art.training.options import TrainOptions
from art.training import sft
from art.training.rank_group import WATCH_INTERVAL_S, PeerWatcher, RankPeers
from art.training.rank_trainers import LeadTrainer, ShardedTrainer
from art.training.ranks import RankSpec
from art.training.sft_options import SFTOptions
from art.training.trainer import Trainer, TrainerHandle
from tests.support.fakes import groups_of_choices
from tests.support.ranks import (assert_same_tensor_updates, assert_same_updates, kill_a_rank_mid_step_then_train,
                                 rank_groups)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}


def tiny_trainer(path, peers=None) -> Trainer | LeadTrainer:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(task_type="CAUSAL_LM", **LORA))
    trainer = Trainer(model, AutoTokenizer.from_pretrained(path))
    return trainer if peers is None else LeadTrainer(trainer, peers)


def state(trainer: Trainer) -> tuple[dict, dict]:
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    moments = {k: v["exp_avg"].clone() for k, v in trainer.optimizer.state_dict()["state"].items()}
    return weights, moments


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


def test_a_handle_on_ranks_says_so_and_sft_refuses_it(tiny_model_path):
    """The trainer kinds implement one declared contract (`TrainerHandle`); a handle on a group
    of ranks has no sole trainer, which is how SFT (one process only) tells it apart."""
    peers = RankPeers(2, RankSpec(str(tiny_model_path), LORA, "cpu", "float32"))  # no process starts here
    lead = tiny_trainer(tiny_model_path, peers=peers)
    assert all(TrainerHandle in kind.__mro__ for kind in (Trainer, LeadTrainer, ShardedTrainer))  # subclassed
    assert lead.sole_trainer() is None and lead.trainer.sole_trainer() is lead.trainer
    assert lead.dtype == lead.trainer.dtype
    with pytest.raises(art.ArtValueError, match="SFT does not support") as info:
        sft.fit(lead, sft.Plan([], 0), SFTOptions())
    assert info.value.field == "trainer_ranks"


@pytest.mark.integration
def test_two_ranks_make_the_single_process_update(tiny_model_path, tmp_path):
    """Two optimizer steps per update (mini_batches=2) and two updates: the second would differ
    if the peer's weights or optimizer state had drifted from rank 0's."""
    groups = [groups_of_choices(seed=1, groups=4, samples=4), groups_of_choices(seed=2, groups=4, samples=4)]
    options = TrainOptions(learning_rate=1e-3, mini_batches=2, micro_batch_tokens=64, packed_row_tokens=32)
    single = tiny_trainer(tiny_model_path)
    single.save(tmp_path / "start")
    start, _ = state(single)
    expected = [single.step(batch, options, quiet=True) for batch in groups]

    peers = RankPeers(2, RankSpec(str(tiny_model_path), LORA, "cpu", "float32"))
    parallel = tiny_trainer(tiny_model_path, peers=peers)
    try:
        parallel.restore(tmp_path / "start")  # starts rank 1, which loads the same checkpoint
        assert parallel.trainer.collective.world == 2 and peers.healthy
        got = [parallel.step(batch, options, quiet=True) for batch in groups]
        assert parallel.trainer.collective.lost is None  # the peer watcher never fired on these healthy steps
    finally:
        peers.close()
    assert_same_updates(expected, got)
    (weights, moments), (want_weights, want_moments) = state(parallel.trainer), state(single)
    assert_same_tensor_updates(start, want_weights, weights, per_element=options.learning_rate)
    # Adam's first moment, a running mean of the gradients (it starts at zero).
    assert_same_tensor_updates({k: torch.zeros_like(v) for k, v in want_moments.items()}, want_moments, moments,
                               per_element=1e-8)
    assert len(parallel.last_trainer_logprobs) == len(single.last_trainer_logprobs)  # rank 1's rows gathered


@pytest.mark.integration
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


def join_then_die_holding_sockets(port: int, connection) -> None:
    """Rank 1: take part in one collective, then die while a child of its own keeps the group's
    sockets open, so rank 0 sees no closed connection (NCCL sees none at all): only rank 0's
    peer watcher can end its wait."""
    collective = start_group(1, 2, torch.device("cpu"), port=port)
    collective.any(False)
    holder = os.fork()
    if holder == 0:  # holds every socket it inherited until the test kills it
        time.sleep(600)
        os._exit(0)
    connection.send(holder)
    connection.recv()
    time.sleep(1.0)  # rank 0 is waiting in its next collective by now
    os._exit(1)


@pytest.mark.integration
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the peer holds its sockets open in a forked child")
def test_a_peer_that_dies_mid_collective_ends_rank_0s_wait_at_once():
    """Rank 0 waits in an all-reduce its peer never joins, and the peer dies: the watcher ends
    the wait with PeerLost within a few polls (gloo alone would wait for the held sockets, NCCL
    for ever). While the peer lives, through a collective and idle polls, it never fires."""
    store = host_store(2)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    peer = context.Process(target=join_then_die_holding_sockets, args=(store.port, theirs), daemon=True)
    peer.start()
    collective = start_group(0, 2, torch.device("cpu"), store=store)
    watcher = PeerWatcher(collective, lambda: None if peer.exitcode is None else (1, peer.exitcode))
    holder = None
    try:
        assert collective.any(False) is False
        holder = ours.recv()
        time.sleep(5 * WATCH_INTERVAL_S)
        assert watcher.fired is None and collective.lost is None
        ours.send("die")
        started = time.monotonic()
        with pytest.raises(PeerLost, match=r"trainer rank 1 died \(exit code 1\)"):
            collective.any(True)
        assert time.monotonic() - started < 1.0 + 10 * WATCH_INTERVAL_S + 5  # not STEP_TIMEOUT's 30 minutes
        assert watcher.fired == "trainer rank 1 died (exit code 1)"
        with pytest.raises(PeerLost):  # a store gather, too, no longer waits for the dead rank
            collective.gather("rows")
    finally:
        watcher.stop()
        if holder is not None:
            os.kill(holder, signal.SIGKILL)
        peer.join(10)


@pytest.mark.integration
async def test_a_rank_killed_mid_step_costs_that_step_only(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="dp", project="p", base_model=str(tiny_model_path),
                               _internal_config={"trainer_ranks": 2})
    await model.register(backend)
    peers = backend.service.loaded(("p", "dp")).trainer.peers
    result = await backend.train(model, await rank_groups(model, 0), learning_rate=1e-2)
    assert result.step == 1
    await kill_a_rank_mid_step_then_train(backend, model, peers, victim=0)
