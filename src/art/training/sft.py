"""Supervised fine-tuning through the GRPO trainer's parts: one call, several optimizer steps.

`prepare` renders trajectories into token sequences (`art.training.chat_tokens`, the one place
training tokenises text) and cuts them into batches of `batch_size` trajectories. `fit` runs one
AdamW step per batch, at that batch's learning rate, on the same packed micro-batches
(`art.training.packing`) and chunked logprobs (`art.training.logprobs`) as a GRPO step, with
the token-normalised negative log-likelihood of the trained tokens:

    L = -(1 / sum_i |y_i|) * sum_i sum_{t in y_i} log p(x_{i,t} | x_{i,<t})

over the batch's sequences i and their assistant tokens y_i. The update transaction around it
(pause the engine, checkpoint, publish, weight-sync probe, roll back) is `art.service.update`'s, the
same as for GRPO: one `train_sft` call writes one checkpoint, whatever its number of batches,
as in ART.

Metrics use ART's sections: each optimizer step reports `loss/train`, `loss/grad_norm`,
`loss/learning_rate` and `data/step_trainer_tokens`; the call's summary averages the first
three and adds `data/` counts and `sft/` details (`art.training.sft_history` turns them into
history rows).

The optimizer is shared with GRPO, but its moments are not (`art.training.optimizer_mode`).
Data-parallel ranks (`trainer_ranks` > 1) are not supported here yet.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from art.errors import ArtValueError, StepCancelledError, TrajectoryError
from art.training import packing
from art.training.chat_tokens import render_chat
from art.training.optimizer_mode import switch_optimizer_mode
from art.training.sequences import Sequence
from art.training.sft_options import SFTOptions
from art.training.trainer import ProgressCallback, Trainer, TrainerHandle

log = logging.getLogger(__name__)


@dataclass
class Batch:
    sequences: list[Sequence]
    learning_rate: float


@dataclass
class Plan:
    """What `prepare` made of a call's trajectories."""

    batches: list[Batch]
    """The batches that train, each one optimizer step; empty when nothing is left to train."""
    trajectories: int
    """Trajectories given, dropped ones included."""
    dropped: int = 0
    """Trajectories left out: a conversation of theirs is longer than the model's context."""

    def counts(self) -> dict[str, float]:
        """What the plan trains, in ART's `data/` names (the whole report when nothing trains)."""
        return {
            "data/step_num_gradient_steps": float(len(self.batches)),
            "data/step_num_trajectories": float(self.trajectories - self.dropped),
            "data/step_num_dropped_trajectories": float(self.dropped),
        }


def prepare(
    trajectories: list,
    options: SFTOptions,
    tokenizer,
    *,
    stop_ids: set[int] | None = None,
    max_tokens: int | None = None,
) -> Plan:
    """Sequences in batches of `batch_size` trajectories. Bad input raises TrajectoryError naming
    `trajectories[i]...`. A trajectory with a conversation longer than `max_tokens` is dropped
    and counted. As in ART, a batch left empty is no optimizer step and uses no learning rate
    (the k-th batch that trains takes the k-th rate of a list), and with nothing left to train
    the plan is empty: the call trains nothing and writes no checkpoint."""
    count = math.ceil(len(trajectories) / options.batch_size)
    if trajectories and isinstance(options.learning_rate, tuple) and len(options.learning_rate) != count:
        raise ArtValueError(
            f"learning_rate has {len(options.learning_rate)} values but {len(trajectories)} "
            f"trajectories make {count} batches of {options.batch_size}: give one value per batch",
            field="learning_rate",
        )
    dropped = 0
    batches: list[Batch] = []
    for b in range(count):
        sequences = []
        for i in range(b * options.batch_size, min((b + 1) * options.batch_size, len(trajectories))):
            rendered = _sequences(trajectories[i], f"trajectories[{i}]", options, tokenizer, stop_ids)
            if max_tokens is not None and any(len(sequence.token_ids) > max_tokens for sequence in rendered):
                dropped += 1
                continue
            for sequence in rendered:
                sequence.group = 0  # one group per batch: a shared system prompt is computed once
                sequence.member = i
                sequences.append(sequence)
        if sequences:
            batches.append(Batch(sequences, options.rate(len(batches))))
    if dropped:
        log.warning(
            "SFT: %d of %d trajectories are longer than the model's context (%s tokens) and left out",
            dropped,
            len(trajectories),
            max_tokens,
        )
    if not batches:
        log.warning("SFT: nothing to train (%d trajectories given): no step, no checkpoint", len(trajectories))
    return Plan(batches, len(trajectories), dropped)


def _sequences(trajectory, where: str, options: SFTOptions, tokenizer, stop_ids) -> list[Sequence]:
    """The main conversation and each of `additional_histories`, rendered."""
    if not hasattr(trajectory, "messages_and_choices"):
        raise TrajectoryError(f"{where} is a {type(trajectory).__name__}, not an art.Trajectory", field=where)
    histories = [(trajectory, f"{where}.messages_and_choices")]
    histories += [
        (h, f"{where}.additional_histories[{j}].messages_and_choices")
        for j, h in enumerate(getattr(trajectory, "additional_histories", None) or [])
    ]
    out = []
    for ordinal, (history, at) in enumerate(histories):
        chat = render_chat(
            tokenizer,
            history.messages(),
            history.tools,
            assistant_turns=options.assistant_turns,
            stop_ids=stop_ids,
            where=at,
        )
        out.append(
            Sequence(
                token_ids=chat.token_ids,
                trained=chat.trained,
                sampler_logprobs=[math.nan] * len(chat.token_ids),
                ordinal=ordinal,
            )
        )
    return out


def fit(
    handle: TrainerHandle,
    plan: Plan,
    options: SFTOptions,
    *,
    desc: str = "sft",
    on_optimizer_step: ProgressCallback | None = None,
    should_stop: Callable[[], bool] | None = None,
    quiet: bool = False,
) -> dict[str, float]:
    """One optimizer step per batch of `plan` on the model of `handle`'s trainer; the step's
    metrics. `on_optimizer_step(done, total, metrics)` follows each step (the HTTP stream's events)."""
    trainer = _trainer_for_sft(handle)
    trainer.last_trainer_logprobs = []  # no sampler to audit against
    switch_optimizer_mode(trainer.optimizer, "sft", options.weight_decay)
    plans = [
        packing.plan(
            [batch.sequences],
            mode=trainer.packing_mode(options.packing),
            row_tokens=options.packed_row_tokens,
            batch_tokens=options.micro_batch_tokens,
        )
        for batch in plan.batches
    ]
    steps: list[OptimizerStep] = []
    with trainer.training(options.gradient_checkpointing, sum(map(len, plans)), desc, quiet) as bar:
        for index, (batch, micro) in enumerate(zip(plan.batches, plans)):
            step = _optimizer_step(trainer, batch, micro, options, should_stop, bar)
            steps.append(step)
            if on_optimizer_step is not None:
                on_optimizer_step(index + 1, len(plan.batches), step.metrics(batch))
            bar.set_postfix(loss=f"{step.loss:.4f}")
    return _summary(trainer, plan, steps)


@dataclass
class OptimizerStep:
    """What one optimizer step measured, for its progress event and the call's summary."""

    loss: float
    norm: float
    learning_rate: float
    tokens_computed: int

    def metrics(self, batch: Batch) -> dict[str, float]:
        """The step's own metrics, in ART's names, as `on_optimizer_step` reports them."""
        return {
            "loss/train": self.loss,
            "loss/grad_norm": self.norm,
            "loss/learning_rate": self.learning_rate,
            "data/step_trainer_tokens": float(sum(len(s.token_ids) for s in batch.sequences)),
        }


def _trainer_for_sft(handle: TrainerHandle) -> Trainer:
    """Refuse, before anything changes, what SFT cannot train: a group of ranks or a merged adapter."""
    trainer = handle.sole_trainer()
    if trainer is None:  # a handle on a group of ranks (`art.training.rank_trainers`)
        raise ArtValueError(
            "SFT does not support data-parallel or sharded (fsdp) trainer ranks yet; register the "
            "model with trainer_ranks=1 and without fsdp for SFT",
            field="trainer_ranks",
        )
    if any(getattr(module, "merged", False) for module in trainer.model.modules()):
        raise RuntimeError("the adapter is merged into the base weights for serving; unmerge it before training")
    return trainer


def _optimizer_step(
    trainer: Trainer,
    batch: Batch,
    micro: list[packing.MicroBatch],
    options: SFTOptions,
    should_stop: Callable[[], bool] | None,
    bar,
) -> OptimizerStep:
    """One AdamW step on `batch` over its micro-batches; raise on divergence so the update rolls back."""
    optimizer = trainer.optimizer
    for group in optimizer.param_groups:
        group["lr"] = batch.learning_rate
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(s.num_trained for s in batch.sequences)
    summed = torch.zeros((), dtype=torch.float64, device=trainer.device)  # read once per optimizer step
    computed = 0
    for part in micro:
        if should_stop is not None and should_stop():
            raise StepCancelledError("the SFT step was cancelled before it finished; it is rolled back")
        inputs = part.to_tensors(trainer.pad_id, trainer.device, trainer.dtype)
        logprobs = trainer.token_logprobs(inputs)  # [sequences, tokens-1], 0 where not trained
        share = -(logprobs * inputs.mask).sum() / tokens  # this micro-batch's part of the mean
        share.backward()
        summed += share.detach()
        computed += part.tokens_computed
        bar.update(1)
    norm = float(torch.nn.utils.clip_grad_norm_(trainer.params, options.max_grad_norm))
    loss = float(summed)
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise _diverged(batch, f"the loss ({loss}) or its gradient norm ({norm}) is not finite")
    optimizer.step()
    if not trainer.weights_finite():  # one sync, not one per tensor
        raise _diverged(batch, "a trained weight became NaN or Inf after the optimizer step")
    return OptimizerStep(loss, norm, batch.learning_rate, computed)


def _summary(trainer: Trainer, plan: Plan, steps: list[OptimizerStep]) -> dict[str, float]:
    """The call's metrics: the steps' averages, first and last loss, and what the plan trained."""
    sequences = [s for batch in plan.batches for s in batch.sequences]
    metrics = {
        "loss/train": sum(step.loss for step in steps) / len(steps),
        "loss/grad_norm": sum(step.norm for step in steps) / len(steps),
        "loss/learning_rate": sum(step.learning_rate for step in steps) / len(steps),
        **plan.counts(),
        "data/step_trainer_tokens": float(sum(len(s.token_ids) for s in sequences)),
        "sft/loss_first": steps[0].loss,
        "sft/loss_last": steps[-1].loss,
        "sft/sequences": float(len(sequences)),
        "sft/trained_tokens": float(sum(s.num_trained for s in sequences)),
        "sft/tokens_computed": float(sum(step.tokens_computed for step in steps)),
    }
    if trainer.device.type == "cuda":
        metrics["sft/peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
    return metrics


def _diverged(batch: Batch, what: str) -> ArtValueError:
    return ArtValueError(
        f"SFT diverged: {what}. The step is rolled back. Likely cause: learning_rate "
        f"{batch.learning_rate:g} is too high for this model; lower it",
        field="learning_rate",
    )
