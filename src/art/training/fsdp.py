"""Full fine-tuning sharded over the trainer ranks with FSDP2 (`fully_shard`).

With `_internal_config={"full_finetune": True, "trainer_ranks": N, "fsdp": True}` each rank
holds 1/N of the float32 weights, gradients and AdamW state, so a model too large to train on
one device trains on N. The data-parallel machinery stays as it is (`art.training.ranks`:
groups sharded by rank, the loss normalised by the whole mini-batch); FSDP2 replaces the one
flat all-reduce with an all-gather of each decoder layer's weights before it runs and a
reduce-scatter (a sum) of its gradients after its backward.

FSDP2 runs on torch's default process group, of which a process has one, so every rank,
rank 0 included, is a process of its own (`RankPeers` with `RankSpec.sharded`); the backend's
process keeps only the engine's served copy of the model, in the serving dtype. That copy is
reloaded from each checkpoint the ranks write (`art.training.rank_trainers.ShardedTrainer`), and the
weight-sync probe asks the ranks for their logprobs, so it compares the served copy with the
trained shards for real.

Collectives need every rank to run the same number of forward and backward passes: a rank with
fewer micro-batches in a mini-batch runs `filler_batch` passes whose loss is multiplied by 0.

Computing in bf16 (CUDA's default) or fp16, FSDP2 itself casts (`mixed_precision`): each unit's
weights are gathered in the compute dtype, and its gradients summed in float32 into the float32
shards, with no autocast around the forward. In float32 (the CPU's default) the weights are
gathered as they are stored.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from art.training import packing
from art.training.logprobs import gathered_logprobs
from art.training.sequences import Sequence
from art.weights import read_shards

OPTIMIZER_FILE = "optimizer_by_name.pt"
"""AdamW state keyed by parameter name (the full, unsharded form), written by rank 0. Not
`optimizer.pt`: the unsharded trainer keys its state by parameter index."""


class ShardedScorer(torch.nn.Module):
    """FSDP2's root unit: it owns the policy's embeddings, final norm and (tied) head, and its
    forward is `gathered_logprobs`, whose chunked path calls the trunk and the head separately
    (not the model's own forward), so the root's weights are gathered around exactly that."""

    def __init__(self, policy) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, model, *args, **kwargs) -> torch.Tensor:
        """`gathered_logprobs(model, ...)`: `model` is the policy, or the unsharded reference."""
        return gathered_logprobs(model, *args, **kwargs)


def mixed_precision(dtype: torch.dtype):
    """FSDP2's policy for computing in `dtype`: in a lower precision than float32, gather the
    weights in `dtype` and sum the gradients in float32 (half the all-gather traffic and memory
    of gathering float32, and the trainer needs no autocast); in float32 FSDP2's default (gather
    as stored)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_model(model, device: torch.device, dtype: torch.dtype = torch.float32) -> ShardedScorer:
    """Shard `model` (float32, on `device`) with FSDP2 over the default group: each decoder layer
    (the classes transformers lists in `_no_split_modules`) is its own unit, the rest (embeddings,
    tied head, final norm) the root's, a `ShardedScorer` around it; returns that root. Gradients
    are summed across ranks, not averaged: the loss is already normalised by the whole mini-batch.
    `dtype` is the compute dtype (`mixed_precision`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision(dtype)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    scorer = ShardedScorer(model)
    fully_shard(scorer, mesh=mesh, mp_policy=policy)  # in place: the same object, now also an FSDPModule
    for unit in scorer.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum
    return scorer


def filler_batch(pad_id: int) -> packing.MicroBatch:
    """A two-token micro-batch whose loss is multiplied by 0: the pass a rank runs so that its
    collectives meet those of ranks with more micro-batches."""
    sequence = Sequence(token_ids=[pad_id, pad_id], trained=[False, True], sampler_logprobs=[math.nan, 0.0], group=-1)
    (batch,) = packing.plan([[sequence]], mode="padded", row_tokens=8, batch_tokens=8)
    return batch


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a plain tensor is returned as it is)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is returned as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def save(trainer, folder: Path) -> None:
    """Every rank gathers; rank 0 writes the whole model (HF format, servable) and the AdamW state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(trainer.model, options=whole)
    optimizer = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=whole)
    # Every rank takes part in gathering the whole state, but only rank 0 writes it (and, in
    # `restore`, reads it): the ranks share the folder's disk, and one copy is the checkpoint.
    if trainer.collective.rank == 0:
        for alias in tied_aliases(trainer.model):  # gathered as copies, they no longer look tied to transformers
            weights.pop(alias, None)
        trainer.model.save_pretrained(str(folder), state_dict=weights)
        torch.save(optimizer, Path(folder) / OPTIMIZER_FILE)


def tied_aliases(model) -> set[str]:
    """Names under which a parameter registered under another name appears again (a head tied
    to the embeddings): a checkpoint stores it once."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}


def restore(trainer, folder: Path) -> None:
    """Rank 0 reads the checkpoint and every rank takes its shard (each rank checks the folder
    itself: they share its disk)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    first = trainer.collective.rank == 0
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    weights: dict = {}
    if first:
        weights = read_shards(folder)
        expected = set(trainer.model.state_dict())
        missing, unexpected = expected - set(weights) - tied_aliases(trainer.model), set(weights) - expected
        if missing or unexpected:
            raise RuntimeError(
                f"checkpoint {folder} does not match the model: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}"
            )
    set_model_state_dict(trainer.model, weights, options=options)
    optimizer_file = Path(folder) / OPTIMIZER_FILE
    if optimizer_file.exists():
        state = torch.load(optimizer_file, weights_only=True) if first else {}
        set_optimizer_state_dict(trainer.model, trainer.optimizer, state, options=options)
