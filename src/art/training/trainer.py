"""One GRPO update of the live LoRA adapter from trajectory groups.

The spine: groups -> advantages -> token sequences -> mini-batches (one AdamW step each, per
epoch) -> packed micro-batches (`art.training.packing`) -> loss -> gradient accumulation.
It shares the model (and so the base weights) with the engine, on the CPU or one GPU: it holds
the model lock while it runs. On CUDA the frozen base weights are bf16 and what is trained is
float32 (peft keeps a LoRA adapter in float32; full fine-tuning keeps float32 master weights
and computes under bf16 autocast). It knows nothing about HTTP or storage layout;
`save`/`restore` write and read one checkpoint folder.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

from art.errors import ArtValueError, StepCancelledError
from art.metrics_taxonomy import TRAIN_GRADIENT_STEPS_KEY
from art.observability import tracing
from art.observability.progress import progress_bar
from art.runtime.architectures import has_recurrent_layers
from art.training import fsdp
from art.training.batch import PackedBatch, pack_batch, report_input
from art.training.collective import Collective
from art.training.logprobs import gathered_logprobs, sequence_logprobs
from art.training.loss import Normalizer, policy_loss_terms
from art.training.optimizer_mode import enter_rl_mode
from art.training.options import ADAMW_BETAS, ADAMW_WEIGHT_DECAY, TrainOptions
from art.training.packing import BatchTensors, MicroBatch
from art.training.sequences import Sequence
from art.weights import base_of, is_peft, load_full_weights, read_adapter, write_adapter

OPTIMIZER_FILE = "optimizer.pt"

ProgressCallback = Callable[[int, int, dict[str, float]], None]
"""`on_optimizer_step(done, total, metrics)`: called after each optimizer step of a training call."""


class TrainerHandle(Protocol):
    """What the service (`art.service`) and SFT (`art.training.sft`) call on a model's trainer,
    whichever kind holds it: a `Trainer` alone in this process, or the handle on a group of
    trainer ranks (`art.training.rank_trainers`: `LeadTrainer`, `ShardedTrainer`). Each kind
    subclasses it, so mypy checks that it implements every member."""

    dtype: torch.dtype
    """The compute dtype (the weight-sync probe's tolerance follows it)."""
    last_trainer_logprobs: list[dict]
    """The last step's `trainer_logprob_rows` (every rank's), for the run's storage."""

    def step(
        self,
        groups,
        options: TrainOptions,
        *,
        desc: str = "train",
        on_optimizer_step: ProgressCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        quiet: bool = False,
    ) -> dict[str, float]:
        """One GRPO update (`Trainer.step`) on every rank; its metrics."""
        ...

    def save(self, folder: Path) -> None:
        """Write the trained weights and the optimizer state as checkpoint `folder`."""
        ...

    def restore(self, folder: Path) -> None:
        """Load checkpoint `folder` (weights and optimizer state) on every rank."""
        ...

    def sync_peers(self, folder: Path) -> None:
        """Bring the peer ranks to checkpoint `folder`, which this side holds already."""
        ...

    def probe_logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        """The weight-sync probe's trainer side: log p of each completion token after the prompt."""
        ...

    def sole_trainer(self) -> Trainer | None:
        """This process's `Trainer` when it trains alone; None when it leads a group of ranks."""
        ...

    def close(self) -> None:
        """Stop the rank processes it leads (nothing to stop for a lone trainer)."""
        ...


class Trainer(TrainerHandle):
    """The GRPO (and SFT) trainer of one process: the lone kind of `TrainerHandle`, and every
    rank's own trainer in a group (`art.training.ranks`)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        lock: threading.RLock | None = None,
        load_reference: Callable[[], torch.nn.Module] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        collective: Collective | None = None,
        gather=None,
    ) -> None:
        """`model`: a PeftModel whose live adapter is trained, or a plain model trained whole
        (full fine-tuning), already on `device` (default: where its weights are). `dtype`: the
        compute dtype (default: the weights'); float32 weights computed in a lower dtype run
        under autocast. `load_reference` gives the frozen base model the KL term (beta > 0)
        needs under full fine-tuning; it is loaded on first use. With LoRA the reference is
        the same model with the adapter disabled. Data parallel (`art.training.ranks`):
        `collective` is this rank's view of the group (`art.training.collective`). `gather`
        computes `gathered_logprobs` (a sharded rank's goes through FSDP's root unit:
        `art.training.fsdp.ShardedScorer`)."""
        self.model = model
        self.gather = gather or gathered_logprobs
        first = next(model.parameters())
        self.device = torch.device(device) if device is not None else first.device
        self.dtype = dtype or first.dtype
        self.autocast = first.dtype == torch.float32 and self.dtype != torch.float32
        self.full_finetune = not is_peft(model)
        self._load_reference = load_reference
        self._reference: torch.nn.Module | None = None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.lock = lock or threading.RLock()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=5e-6, betas=ADAMW_BETAS, weight_decay=ADAMW_WEIGHT_DECAY)
        self.last_trainer_logprobs: list[dict] = []
        """The last step's `trainer_logprob_rows`, for the run's storage."""
        self.collective = collective or Collective()
        self.last_tokens_per_s: float | None = None
        """What the last step computed: its sequences' tokens (times epochs) per second of its
        passes; the next step's announced estimate (`announce_step`)."""
        self.one_sequence_per_row = has_recurrent_layers(base_of(model).config)
        """A layer keeps a recurrent state (Gated DeltaNet, Mamba, short convolutions): an
        attention mask does not stop it flowing from one sequence into the next in a packed
        row, so every sequence gets a row of its own (`packing_mode`)."""

    def packing_mode(self, requested: str) -> str:
        """The packing a step uses: the requested one, or "padded" (a row per sequence, right
        padding after it, which a causal recurrence never reads) on a model with recurrent layers."""
        return "padded" if self.one_sequence_per_row else requested

    # -- the handle -----------------------------------------------------------------------
    def sole_trainer(self) -> Trainer:
        """Itself: it trains alone."""
        return self

    def sync_peers(self, folder: Path) -> None:
        """A lone trainer has no peers."""

    def close(self) -> None:
        """Nothing runs beside a lone trainer."""

    # -- the update -----------------------------------------------------------------------
    def step(
        self,
        groups,
        options: TrainOptions,
        *,
        desc: str = "train",
        on_optimizer_step: ProgressCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        quiet: bool = False,
    ) -> dict[str, float]:
        """Apply one update (`options.optimizer_steps` AdamW steps); returns metrics (with
        `skipped/<reason>` counts, `context_assistant_turns` and, when nothing could be trained,
        `nothing_to_train` = 1 and a warning that says why and, when every group's rewards were
        equal, what to do about it). `on_optimizer_step(done, total, metrics)` follows each
        optimizer step. Rank 0 of a group trains through `art.training.rank_trainers.LeadTrainer`,
        which keeps its peers in step."""
        self.last_trainer_logprobs = []
        if any(getattr(module, "merged", False) for module in self.model.modules()):
            raise RuntimeError(
                "the adapter is merged into the base weights for serving; unmerge it before training "
                "(AdapterSet.unmerge)"
            )
        options = replace(options, packing=self.packing_mode(options.packing))
        batch = pack_batch(list(groups), options, self.collective)
        metrics = report_input(batch, options)
        if not batch.sequences:
            return metrics
        sums, norms = self.run_optimizer_steps(batch, options, desc, on_optimizer_step, should_stop, quiet)
        metrics.update(self.step_metrics(batch, options, sums, norms))
        self.last_trainer_logprobs = sorted(
            (row for rows in self.collective.gather(trainer_logprob_rows(batch.sequences)) for row in rows),
            key=lambda row: (row["group"], row["trajectory"], row["sequence"]),
        )
        return metrics

    def run_optimizer_steps(
        self,
        batch: PackedBatch,
        options: TrainOptions,
        desc: str,
        on_optimizer_step: ProgressCallback | None,
        should_stop: Callable[[], bool] | None,
        quiet: bool,
    ) -> tuple[dict[str, float], list[float]]:
        """The optimizer loop: every mini-batch's AdamW step, each epoch; the summed terms of
        every step (for metrics) and each step's gradient norm."""
        enter_rl_mode(self.optimizer)  # AdamW's moments restart after SFT steps (art.training.sft)
        for group in self.optimizer.param_groups:
            group["lr"] = options.learning_rate
        sums: dict[str, float] = {}
        norms: list[float] = []
        total_steps = len(batch.parts) * options.epochs
        tokens = sum(len(s.token_ids) for s in batch.sequences)
        if not quiet and self.device.type == "cpu" and self.collective.rank == 0:
            tqdm.write(self.announce_step(desc, tokens, len(batch.sequences), options.epochs))
        began = time.monotonic()
        passes = total_steps * sum(map(len, batch.plans))
        with self.training(options.gradient_checkpointing, passes, desc, quiet) as bar:
            before = [self._pre_update_logprobs(p) for p in batch.plans] if options.precalculate_logprobs else None
            for epoch in range(options.epochs):
                for index, (part, micro) in enumerate(zip(batch.parts, batch.plans)):
                    done = self._optimizer_step(
                        part, micro, options, before[index] if before else None, bar, should_stop, record=epoch == 0
                    )
                    for key, value in done.items():
                        sums[key] = sums.get(key, 0.0) + value
                    norms.append(done["grad_norm"])
                    if on_optimizer_step is not None:
                        on_optimizer_step(len(norms), total_steps, {"loss": done["loss"], "grad_norm": norms[-1]})
        elapsed = time.monotonic() - began
        if elapsed > 0:
            self.last_tokens_per_s = tokens * options.epochs / elapsed
        return sums, norms

    def step_metrics(
        self, batch: PackedBatch, options: TrainOptions, sums: dict[str, float], norms: list[float]
    ) -> dict[str, float]:
        """What a step that trained reports: means of its loss terms over the trained tokens
        (and over its optimizer steps), and its token counts (every rank's)."""
        sequences = batch.sequences
        total_trained = sum(s.num_trained for s in sequences) * options.epochs  # token terms seen
        computed = sum(m.tokens_computed for micro in batch.plans for m in micro if m is not None)
        metrics = {
            "loss": sums["loss"] / len(norms),
            "policy_loss": sums["policy_loss"] / total_trained,
            "clip_fraction": sums["clipped_tokens"] / total_trained,
            "ratio_mean": sums["ratio"] / total_trained,
            "grad_norm": sum(norms) / len(norms),
            "optimizer_steps": float(len(norms)),
            TRAIN_GRADIENT_STEPS_KEY: float(len(norms)),  # ART's name for the same count
            "trained_tokens": float(sum(s.num_trained for s in sequences)),
            "tokens_in_batch": float(sum(len(s.token_ids) for s in sequences)),
            "tokens_computed": float(self.collective.sum_values({"tokens_computed": computed})["tokens_computed"]),
            "sequences": float(len(sequences)),
        }
        if self.device.type == "cuda":
            metrics["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / total_trained
        metrics["entropy"] = sums["entropy"] / total_trained  # mean over trained tokens: falls as the policy collapses
        if "tis_weight" in sums:  # truncated importance sampling: mean weight, share capped
            metrics["tis_weight_mean"] = sums["tis_weight"] / total_trained
            metrics["tis_truncated_fraction"] = sums["tis_truncated"] / total_trained
        return metrics

    def announce_step(self, desc: str, tokens: int, sequences: int, epochs: int = 1) -> str:
        """The line said before a step on the CPU, where a step takes long enough to wonder:
        what it trains on and, at the rate the last step measured, about how long it takes."""
        passes = f" x {epochs} epochs" if epochs > 1 else ""
        plural = "s" if sequences != 1 else ""
        head = f"[art] {desc}: training on {tokens:,} tokens in {sequences} sequence{plural}{passes}"
        rate = self.last_tokens_per_s
        if not rate:
            return f"{head} (first step: no estimate yet)"
        return f"{head} (~{_seconds(tokens * epochs / rate)} at the last step's {rate:,.0f} tok/s)"

    def _optimizer_step(
        self,
        part: list[Sequence],
        micro: list[MicroBatch | None],
        options: TrainOptions,
        before: list[torch.Tensor | None] | None,
        bar,
        should_stop: Callable[[], bool] | None = None,
        record: bool = False,
    ) -> dict[str, float]:
        """Gradient accumulation over `micro`, then one clipped AdamW step; sums for metrics.
        `record`: keep each sequence's trainer logprobs (`Sequence.trainer_logprobs`). A None
        batch (sharded) is a filler pass that adds nothing to the gradients."""
        normalizer = Normalizer(
            options.loss_normalization, sum(s.num_trained for s in part), len(part), options.max_tokens_normalizer
        )
        totals: dict[str, torch.Tensor] = {}  # on the device: read once, after the last micro-batch
        self.optimizer.zero_grad(set_to_none=True)
        stopped = False
        with tracing.span("art.train.forward_backward", {"art.micro_batches": len(micro)}):
            for i, batch in enumerate(micro):
                if should_stop is not None and should_stop() and not self.collective.sharded:
                    stopped = True  # (sharded ranks stop between optimizer steps: their passes are collectives)
                    break
                if batch is None:
                    self._filler_pass(options, normalizer)
                    continue
                terms = self._forward(batch, options, normalizer, None if before is None else before[i], record)
                terms["loss"].backward()  # this micro-batch's share of the mini-batch loss
                for k, v in terms.items():
                    totals[k] = totals[k] + v.detach().double() if k in totals else v.detach().double()
                bar.update(1)
            stopped = stopped or (self.collective.sharded and should_stop is not None and should_stop())
        sums: dict[str, float] = dict(zip(totals, torch.stack(list(totals.values())).tolist())) if totals else {}
        if self.collective.any(stopped):  # every rank stops together, or the others would wait forever
            raise StepCancelledError("the training step was cancelled before it finished; it is rolled back")
        if self.collective.world > 1:
            with tracing.span("art.train.all_reduce", {"art.ranks": self.collective.world}):
                self.collective.sum_gradients(self.params)
                sums = self.collective.sum_values(sums)
        with tracing.span("art.train.optimizer"):
            sums["grad_norm"] = float(
                fsdp.full_value(torch.nn.utils.clip_grad_norm_(self.params, options.max_grad_norm))
            )
            if not (math.isfinite(sums["loss"]) and math.isfinite(sums["grad_norm"])):
                raise _diverged(
                    options, f"the loss ({sums['loss']}) or its gradient norm ({sums['grad_norm']}) is not finite"
                )
            self.optimizer.step()
        if self.collective.any(not self.weights_finite()):
            raise _diverged(options, "a trained weight became NaN or Inf after the optimizer step")
        return sums

    def weights_finite(self) -> bool:
        """No trained weight (this rank's shard of it) is NaN or Inf: one device sync in all."""
        return bool(torch.stack([torch.isfinite(fsdp.local_part(p)).all() for p in self.params]).all())

    def _filler_pass(self, options: TrainOptions, normalizer: Normalizer) -> None:
        """A forward and backward whose loss is multiplied by 0, so this rank's FSDP collectives
        meet those of a rank with more micro-batches (`art.training.fsdp`)."""
        terms = self._forward(fsdp.filler_batch(self.pad_id), options, normalizer)
        (terms["loss"] * 0.0).backward()

    @contextlib.contextmanager
    def training(self, gradient_checkpointing: bool, micro_batches: int, desc: str, quiet: bool):
        """The model in training mode under the lock, with a progress bar over `micro_batches`
        (yielded); on the way out, gradients dropped, eval mode back, the bar closed. GRPO and
        SFT steps (`art.training.sft`) run inside it."""
        bar = progress_bar(total=micro_batches, desc=desc, unit="batch", leave=False, disable=quiet)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.lock:
            self.set_gradient_checkpointing(gradient_checkpointing)
            self.model.train()
            try:
                yield bar
            finally:
                self.optimizer.zero_grad(set_to_none=True)
                self.model.eval()
                bar.close()

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """transformers >= 5 names it activation checkpointing; older ones gradient checkpointing."""
        base = base_of(self.model)
        new_names = hasattr(type(base), "is_activation_checkpointing")
        if (base.is_activation_checkpointing if new_names else base.is_gradient_checkpointing) == enabled:
            return
        if enabled and new_names:
            base.activation_checkpointing_enable({"use_reentrant": False})
        elif enabled:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            (base.activation_checkpointing_disable if new_names else base.gradient_checkpointing_disable)()

    def compute_precision(self):
        """The forward pass's precision: autocast to `dtype` over float32 weights, else as stored."""
        if self.autocast:
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    def token_logprobs(self, inputs: BatchTensors, with_entropy: bool = False):
        """Trainer logprobs of the trained tokens, laid out like `inputs.mask`; 0 elsewhere.
        With `with_entropy`, also the entropy of each trained token's distribution, laid out alike."""
        with self.compute_precision():
            values = self.gather(
                self.model,
                inputs.ids,
                inputs.attention,
                inputs.sources,
                inputs.targets,
                position_ids=inputs.positions,
                with_entropy=with_entropy,
            )
        out = torch.zeros(inputs.mask.shape, dtype=values.dtype, device=values.device)
        if not with_entropy:
            return out.index_put(inputs.scatter, values)
        return out.index_put(inputs.scatter, values[0]), out.index_put(inputs.scatter, values[1])

    @torch.no_grad()
    def _pre_update_logprobs(self, batches: list[MicroBatch | None]) -> list[torch.Tensor | None]:
        """The current policy's logprobs of every micro-batch, before any gradient (a filler
        batch's pass is run and dropped)."""
        out = []
        for batch in batches:
            filled = batch if batch is not None else fsdp.filler_batch(self.pad_id)
            values = self.token_logprobs(filled.to_tensors(self.pad_id, self.device, self.dtype))
            out.append(values if batch is not None else None)
        return out

    @torch.no_grad()
    def probe_logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        """log p of each completion token after the prompt, with the function the loss uses
        (the weight-sync probe's trainer side)."""
        ids = torch.tensor([prompt + completion], device=self.device)  # [1, tokens]
        with self.lock, self.compute_precision():
            values = sequence_logprobs(self.model, ids, torch.ones_like(ids), gather=self.gather)  # [1, tokens - 1]
        return values[0, len(prompt) - 1 :].tolist()

    def _forward(
        self,
        batch: MicroBatch,
        options: TrainOptions,
        normalizer: Normalizer,
        before: torch.Tensor | None = None,
        record: bool = False,
    ) -> dict[str, torch.Tensor]:
        inputs = batch.to_tensors(self.pad_id, self.device, self.dtype)
        new, entropy = self.token_logprobs(inputs, with_entropy=True)  # [sequences, tokens-1] each
        if record:
            keep_trainer_logprobs(batch.sequences, new if before is None else before)
        ref = None
        if options.beta > 0:
            ref = self._reference_logprobs(inputs)
        sampler = inputs.sampler
        epsilon, epsilon_high = options.clip_range()
        return policy_loss_terms(
            new,
            sampler if before is None else before,
            inputs.advantages,
            inputs.mask,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            beta=options.beta,
            ref_logprobs=ref,
            ppo=options.ppo,
            importance_sampling_level=options.importance_sampling_level,
            sampler_logprobs=None if before is None else sampler,
            truncated_importance_sampling=options.truncated_importance_sampling,
            normalizer=normalizer,
            entropy=entropy,
            entropy_bonus=options.entropy_bonus,
        )

    @torch.no_grad()
    def _reference_logprobs(self, inputs: BatchTensors) -> torch.Tensor:
        if not self.full_finetune:
            with self.model.disable_adapter():
                return self.token_logprobs(inputs)
        if self._reference is None:
            if self._load_reference is None:
                raise ArtValueError(
                    "beta > 0 under full fine-tuning needs the base model as reference; "
                    "this trainer was built without one",
                    field="beta",
                )
            self._reference = self._load_reference().eval().requires_grad_(False)
        trained, self.model = self.model, self._reference
        try:
            return self.token_logprobs(inputs)
        finally:
            self.model = trained

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        """The adapter (peft format) or, under full fine-tuning, the whole model (HF format),
        servable by vLLM either way; and the optimizer state."""
        if self.collective.sharded:
            return fsdp.save(self, folder)
        with self.lock:
            if self.full_finetune:
                self.model.save_pretrained(str(folder))
            else:
                write_adapter(self.model, folder)
            torch.save(self.optimizer.state_dict(), Path(folder) / OPTIMIZER_FILE)

    def restore(self, folder: Path) -> None:
        if self.collective.sharded:
            return fsdp.restore(self, folder)
        with self.lock:
            if self.full_finetune:
                load_full_weights(self.model, Path(folder))
            else:
                self._restore_adapter(Path(folder))
            optimizer_file = Path(folder) / OPTIMIZER_FILE
            if optimizer_file.exists():
                self.optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True, map_location=self.device))

    def _restore_adapter(self, folder: Path) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, read_adapter(folder), adapter_name="default")
        missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
        if missing:
            raise RuntimeError(f"checkpoint {folder} does not match the adapter: {missing[:3]}")


def _diverged(options: TrainOptions, what: str) -> ArtValueError:
    return ArtValueError(
        f"training diverged: {what}. The step is rolled back. Likely cause: learning_rate "
        f"{options.learning_rate:g} is too high for this model (or extreme rewards); lower it",
        field="learning_rate",
    )


def keep_trainer_logprobs(batch: list[Sequence], logprobs: torch.Tensor) -> None:
    """Each sequence's trainer logprobs (laid out like `Trainer.token_logprobs`: position t-1 holds
    token t) on the sequence, for the token audit to set beside the sampler's: the pre-update
    ones with precalculate_logprobs, otherwise the first forward pass's (before this step's
    first optimizer step for the first mini-batch, after the earlier ones for the others)."""
    rows = logprobs.detach().float().cpu().tolist()
    for sequence, row in zip(batch, rows):
        sequence.trainer_logprobs = [
            None,
            *(round(row[t - 1], 6) if sequence.trained[t] else None for t in range(1, len(sequence.token_ids))),
        ]


def trainer_logprob_rows(sequences: list[Sequence]) -> list[dict]:
    """What the dashboard's token view reads (one row per trained sequence): where the sequence
    comes from and its trainer logprobs."""
    return [
        {"group": s.group, "trajectory": s.member, "sequence": s.ordinal, "logprobs": s.trainer_logprobs}
        for s in sequences
        if s.trainer_logprobs is not None
    ]


def _seconds(seconds: float) -> str:
    """A duration as a person reads it: "9 s", "2.5 s", "3 min 10 s"."""
    if seconds < 10:
        return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"
