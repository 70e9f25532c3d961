"""`LoadedModel`: everything the backend holds for one trainable model: weights, engine, trainer, storage.

The engine and the trainer share one model on one device, a PeftModel or, with
`full_finetune`, the plain model: the base weights exist once (bf16 on CUDA), and a weight update
reaches the engine with no reload or transfer. With a LoRA adapter the engine serves its own
copy of the live factors (`serve_while_training`), so a training step runs beside it and the
engine only takes the new copy when the step is published; otherwise one lock keeps sampling
and a training step from overlapping. Sharded full fine-tuning (`fsdp`, `art.training.fsdp`)
is the exception: rank processes hold the trained weights, and the engine's copy loads each
checkpoint.

`art.service.build` loads one; `art.service.update` changes its weights, one transaction per step.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

from art.engine.base import AdapterRef, ServedModel
from art.errors import ModelNotFoundError
from art.naming import echo, model_part, parse_served_name
from art.storage import CheckpointStore, ModelDir
from art.training.options import TrainOptions
from art.training.validate import check_groups
from art.weights import adapter_tensors

if TYPE_CHECKING:
    from art.training.trainer import TrainerHandle  # torch: imported only by `art.service.build`


class LoadedModel:
    training_since: float | None = None
    """time.monotonic() when the running update started (None: none running); the watchdog reads it."""
    training_thread: int | None = None
    """The thread running that update."""

    def __init__(
        self,
        *,
        name: str,
        project: str,
        base_model: str,
        dir: ModelDir,
        full_finetune: bool,
        device,
        model,
        tokenizer,
        lock: threading.RLock,
        adapters,
        engine,
        replicas,
        trainer: TrainerHandle,
        store: CheckpointStore,
        step: int,
        model_json: dict,
        serve_while_training: bool = False,
        thread_split: tuple[int, int] | None = None,
    ) -> None:
        self.name, self.project, self.base_model = name, project, base_model
        self.dir = dir
        self.full_finetune = full_finetune
        self.device = device
        self.model, self.tokenizer = model, tokenizer
        self.lock = lock
        self.adapters = adapters
        self.engine = engine
        self.replicas = replicas
        self.trainer = trainer
        self.store = store
        self.step = step
        self.model_json = model_json
        """What model.json holds; `art.service.update` adds the shown options and forks to it."""
        self.serve_while_training = serve_while_training
        """A training step runs beside the serving engine (False: it pauses the engine)."""
        self.thread_split = thread_split
        """(engine, trainer) torch threads while a step runs beside the engine on the CPU."""
        self.shown_options: TrainOptions | None = None
        self.train_lock = asyncio.Lock()
        """One update at a time per model."""
        self.cancelled = threading.Event()  # set by `cancel`: the running step stops and rolls back
        self.train_calls = 0  # train calls running or waiting for the training lock

    # -- serving ----------------------------------------------------------------------------
    def resolve(self, requested: str) -> ServedModel:
        """`name` -> latest step, `name@N` -> step N, the base model id -> no adapter."""
        if requested == self.base_model:
            if self.full_finetune:
                raise ModelNotFoundError(
                    f"model {echo(requested)}: a fully fine-tuned model keeps no separate base "
                    f"weights; ask for {self.name!r}"
                )
            return ServedModel(requested, self.serving, None, 0)
        if model_part(requested) != self.name:
            raise ModelNotFoundError(f"model {echo(requested)} not found")
        _, step = parse_served_name(requested)
        if step is None:  # the engine picks the live weights when sampling starts
            return ServedModel(requested, self.serving, AdapterRef(self.name, None, None), self.step)
        if self.full_finetune and step != self.step:
            raise ModelNotFoundError(
                f"model {echo(requested)}: only the latest step ({self.step}) of a fully fine-tuned model is served"
            )
        if step not in self.store.steps():
            raise ModelNotFoundError(
                f"model {echo(requested)}: no checkpoint for step {step} (available: {self.store.steps()})"
            )
        return ServedModel(requested, self.serving, AdapterRef(requested, self.store.path(step), step), step)

    @property
    def serving(self):
        """The engine requests go to: the replica set when there are replicas, else the one engine."""
        return self.replicas if self.replicas is not None else self.engine

    def publish_step(self) -> None:
        """The engine serves `step` as the live weights (its checkpoint is written already)."""
        self.engine.weights_updated(self.step, self.store.path(self.step))

    def stats(self) -> dict:
        return {"step": self.step, **self.engine.stats(), **(self.replicas.stats() if self.replicas else {})}

    def live_weights(self):
        """What replicas load to hold the live weights: the adapter's tensors (on the CPU), or,
        fully fine-tuned, the current checkpoint's folder."""
        if self.full_finetune:
            return self.store.path(self.step)
        with self.lock:
            return adapter_tensors(self.model)

    async def restart_replicas(self) -> list[int]:
        """Start the replicas that left the rotation again, on the current weights; their indices."""
        if self.replicas is None:
            return []
        async with self.train_lock:  # not while a step publishes new weights
            return await asyncio.to_thread(self.replicas.restart, self.step, self.live_weights())

    def served_names(self) -> list[str]:
        steps = [self.step] if self.full_finetune else self.store.steps()
        return [self.name] + [f"{self.name}@{s}" for s in steps]

    # -- training input ---------------------------------------------------------------------
    def check_groups(self, groups) -> None:
        """Refuse malformed training input (`art.training.validate`) with a TrajectoryError."""
        check_groups(groups, vocab_size=self.model.get_input_embeddings().num_embeddings, context=self.context_length())

    def context_length(self) -> int:
        return getattr(self.model.config, "max_position_embeddings", None) or self.engine.max_model_len

    def prepare_sft(self, trajectories: list, options):
        """Render SFT trajectories (`art.training.sft`), so bad input is refused before anything moves."""
        from art.training import sft

        return sft.prepare(
            trajectories, options, self.tokenizer, stop_ids=self.engine.eos_ids, max_tokens=self.context_length()
        )

    def fit_sft(self, plan, options, **kwargs) -> dict:
        """The SFT update (`art.training.sft.fit`), the step function `run_update` calls for SFT."""
        from art.training import sft

        return sft.fit(self.trainer, plan, options, **kwargs)

    def cancel(self) -> bool:
        """Stop the running (or waiting) training steps at their next micro-batch; they raise
        StepCancelledError and roll back. False when no train call is in progress."""
        if not self.train_calls:
            return False
        self.cancelled.set()
        return True

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread (so the weights can be freed), any replicas and trainer ranks."""
        self.engine.stop()
        if self.replicas is not None:
            self.replicas.close()
        self.trainer.close()

    def delete_checkpoints(self, keep: set[int]) -> list[int]:
        deleted = []
        for step in self.store.steps():
            if step not in keep and step != self.step:
                self.store.delete(step)
                deleted.append(step)
        return deleted
