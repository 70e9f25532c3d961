"""Full fine-tuning sharded over trainer ranks with FSDP2 (`art.training.fsdp`): two gloo
ranks, each holding half of the weights, gradients and AdamW state, make the update one process
makes; the backend serves what they trained, and a rank that dies costs that step only."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

import art
from art.training.batch import plan_micro_batches, prepare_batch, split_mini_batches
from art.training.collective import Collective
from art.training.fsdp import OPTIMIZER_FILE
from art.training.options import TrainOptions
from art.training.rank_group import RankPeers
from art.training.rank_trainers import ShardedTrainer
from art.training.ranks import RankSpec
from art.training.trainer import Trainer
from tests.support.fakes import greedy_logprobs, groups_of_choices
from tests.support.ranks import (assert_same_tensor_updates, assert_same_updates, kill_a_rank_mid_step_then_train,
                                 rank_groups)

OPTIONS = TrainOptions(learning_rate=1e-3, mini_batches=2, micro_batch_tokens=32, packed_row_tokens=24)


def full_trainer(path) -> Trainer:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).requires_grad_(True).eval()
    return Trainer(model, AutoTokenizer.from_pretrained(path))


def micro_batch_counts(groups, rank: int) -> list[int]:
    sequences, _, _ = prepare_batch(groups, OPTIONS)
    parts = [p for p in split_mini_batches(sequences, OPTIONS.mini_batches) if p]
    return [len(plan_micro_batches(Collective(rank, 2).shard(part), OPTIONS)) for part in parts]


@pytest.mark.integration
def test_two_sharded_ranks_make_the_single_process_update(tiny_model_path, tmp_path):
    """Two updates of two optimizer steps each; the first batch gives the ranks unequal numbers
    of micro-batches, so filler passes must keep their collectives in step without adding to
    the gradients."""
    batches = [groups_of_choices(seed=1, groups=5, samples=4), groups_of_choices(seed=2, groups=4, samples=4)]
    assert micro_batch_counts(batches[0], 0) != micro_batch_counts(batches[0], 1)
    single = full_trainer(tiny_model_path)
    single.save(tmp_path / "start")
    (tmp_path / "start" / "optimizer.pt").unlink()  # both start with fresh AdamW state
    expected = [single.step(batch, OPTIONS, quiet=True) for batch in batches]
    single.save(tmp_path / "single")

    served, _ = art.base_models.load(str(tiny_model_path))
    peers = RankPeers(2, RankSpec(str(tiny_model_path), None, "cpu", "float32", sharded=True))
    sharded = ShardedTrainer(served, peers, lock=threading.RLock(), device=torch.device("cpu"), dtype=torch.float32)
    try:
        sharded.restore(tmp_path / "start")
        progress: list = []
        got = [sharded.step(batch, OPTIONS, on_optimizer_step=lambda *event: progress.append(event))
               for batch in batches]
        sharded.save(tmp_path / "sharded")
        probe = sharded.probe_logprobs([1, 2, 3, 4], [5, 6, 7])
    finally:
        peers.close()
    assert_same_updates(expected, got)
    assert [event[:2] for event in progress] == [(1, 2), (2, 2)] * 2  # rank 0's progress reached the backend
    assert len(sharded.last_trainer_logprobs) == len(single.last_trainer_logprobs)  # both ranks' rows

    start, want_weights, weights = (load_file(str(tmp_path / folder / "model.safetensors"))
                                    for folder in ("start", "single", "sharded"))
    assert_same_tensor_updates(start, want_weights, weights, per_element=OPTIONS.learning_rate)
    served_weights = dict(served.named_parameters())
    for name, value in weights.items():  # the backend serves exactly what the ranks saved
        assert torch.equal(served_weights[name].detach(), value), name
    names = [name for name, p in single.model.named_parameters() if p.requires_grad]
    want_moments = {names[index]: state["exp_avg"] for index, state in single.optimizer.state_dict()["state"].items()}
    moments = {name: state["exp_avg"]
               for name, state in torch.load(tmp_path / "sharded" / OPTIMIZER_FILE, weights_only=True)["state"].items()}
    assert_same_tensor_updates({k: torch.zeros_like(v) for k, v in want_moments.items()}, want_moments, moments,
                               per_element=1e-8)  # Adam's first moment (it starts at zero)
    assert probe == pytest.approx(single.probe_logprobs([1, 2, 3, 4], [5, 6, 7]), abs=1e-5)


@pytest.mark.integration
async def test_the_backend_serves_what_the_sharded_ranks_train_and_survives_a_dead_rank(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="fsdp", project="p", base_model=str(tiny_model_path),
                               _internal_config={"full_finetune": True, "trainer_ranks": 2, "fsdp": True})
    await model.register(backend)
    service = backend.service.loaded(("p", "fsdp"))
    peers = service.trainer.peers
    assert [p.is_alive() for p in peers.transport.processes] == [True, True]  # rank 0 too: a process of its own
    assert not any(p.requires_grad for p in service.model.parameters())  # the backend keeps a served copy only

    before = await greedy_logprobs(model, "fsdp")
    result = await backend.train(model, await rank_groups(model, 0), learning_rate=1e-2)
    assert result.step == 1 and result.metrics["weight_sync_max_abs_diff"] <= 1e-4
    trained = await greedy_logprobs(model, "fsdp")
    assert max(abs(a - b) for a, b in zip(trained, before)) > 1e-3  # the served copy took the new weights
    files = set(p.name for p in (tmp_path / "p" / "models" / "fsdp" / "checkpoints" / "0001").iterdir())
    assert {"model.safetensors", "config.json", OPTIMIZER_FILE} <= files

    await kill_a_rank_mid_step_then_train(backend, model, peers, victim=1)


def bf16_rank(path: str, connection) -> None:
    """A one-rank sharded trainer computing in bfloat16 (CUDA's default dtype, here on the CPU):
    what its forward sees, and what one step does to its float32 shards."""
    from art.training.collective import host_store, join_default_group
    from art.training.ranks import build_trainer
    from art.training.options import TrainOptions

    store = host_store(2)  # the backend's: one rank, plus the holder
    trainer = build_trainer(RankSpec(path, None, "cpu", "bfloat16", sharded=True),
                            join_default_group(0, 1, torch.device("cpu"), store.port))
    seen = set()
    trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: seen.add((module.weight.dtype, out.dtype)))
    before = {name: p.full_tensor().clone() for name, p in trainer.model.named_parameters()}
    metrics = trainer.step(groups_of_choices(seed=1, groups=2, samples=4), TrainOptions(learning_rate=1e-3), quiet=True)
    moved = [name for name, p in trainer.model.named_parameters() if not torch.equal(p.full_tensor(), before[name])]
    connection.send((trainer.autocast, seen, {p.dtype for p in trainer.model.parameters()}, len(moved), len(before),
                     metrics["loss"], metrics["grad_norm"]))


@pytest.mark.integration
def test_sharded_ranks_gather_weights_in_the_compute_dtype(tiny_model_path):
    """Item 20 of the GPU review: in bfloat16, FSDP2 gathers each unit's weights in bfloat16 (half
    of float32's traffic) and sums gradients in float32 into float32 shards, with no autocast; in
    float32 it gathers as stored."""
    import math
    import multiprocessing

    from art.training.fsdp import mixed_precision

    assert mixed_precision(torch.float32).param_dtype is None
    policy = mixed_precision(torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)

    context = multiprocessing.get_context("spawn")  # a default process group of its own
    ours, theirs = context.Pipe()
    rank = context.Process(target=bf16_rank, args=(str(tiny_model_path), theirs), daemon=True)
    rank.start()
    try:
        assert ours.poll(240), f"the rank ended (exit code {rank.exitcode}) or hung"
        autocast, seen, shards, moved, total, loss, grad_norm = ours.recv()
    finally:
        rank.join(30)
    assert not autocast and seen == {(torch.bfloat16, torch.bfloat16)}
    assert shards == {torch.float32} and moved == total  # every float32 shard took the step
    assert math.isfinite(loss) and grad_norm > 0


def test_fsdp_needs_full_fine_tuning():
    from art.service.settings import parse_internal_config

    with pytest.raises(art.ArtValueError) as error:
        parse_internal_config({"trainer_ranks": 2, "fsdp": True})
    assert error.value.field == "fsdp"
    with pytest.raises(art.ArtValueError, match="fsdp must be True or False"):
        parse_internal_config({"full_finetune": True, "fsdp": "yes"})
    assert parse_internal_config({"full_finetune": True, "trainer_ranks": 2, "fsdp": True}).fsdp
