"""Everything the backend holds for one trainable model: weights, engine, trainer, storage.

The engine and the trainer share one model on one device, a PeftModel or, with
`full_finetune`, the plain model: the base weights exist once (bf16 on CUDA), a weight update is
visible to the next request with no reload or transfer, and one lock keeps sampling and a
training step from overlapping. Sharded full fine-tuning (`fsdp`, `art.training.sharded`) is the
exception: rank processes hold the trained weights, and the engine's copy loads each checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import ctypes
import logging
import os
import sys
import threading
import time

import torch
from tqdm.auto import tqdm

from art import base_models, weight_sync
from art.observability import tracing
from art.engine import cuda_graphs
from art.engine.adapters import AdapterSet
from art.engine.base import AdapterRef
from art.engine.llm_engine import LLMEngine
from art.errors import ArtValueError, ModelNotFoundError, StepConflictError, WeightSyncError
from art.internal_config import parse_internal_config
from art.naming import echo, model_part, parse_served_name
from art.server.registry import ServedModel
from art.service import TrainResult
from art.storage import CheckpointStore, ModelDir
from art.storage.run_log import write_trainer_logprobs
from art.training.options import TrainOptions
from art.training.trainer import Trainer
from art.training.validate import check_groups

log = logging.getLogger(__name__)


def bound_malloc_growth() -> None:
    """Stop glibc from keeping freed tensor memory (RSS grew ~3 GB per step without this).

    glibc raises its mmap threshold after large frees, so later 1-32 MB tensors come from
    per-thread heaps that fragment; sampler, trainer and server threads then pile up freed
    memory. A fixed threshold (what MALLOC_MMAP_THRESHOLD_ does) returns it to the OS.
    """
    if sys.platform != "linux" or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except (OSError, AttributeError):
        pass


class ModelService:
    training_since: float | None = None
    """time.monotonic() when the running update started (None: none running); the watchdog reads it."""
    training_thread: int | None = None
    """The thread running that update."""

    def __init__(self, root, *, name: str, project: str, base_model: str, internal_config: dict | None = None,
                 user_config: dict | None = None, placement: str = "processes") -> None:
        """`placement`: where engine replicas and trainer ranks 1..N-1 run unless the model's
        internal config says: "processes" or "ray" (`art.ray_cluster`)."""
        bound_malloc_growth()
        internal = dict(internal_config or {})
        settings = parse_internal_config(internal)  # ArtValueError naming the field, before any loading
        engine_config = settings.engine.resolve()
        self.name, self.project, self.base_model = name, project, base_model
        self.dir = ModelDir(root, project, name)
        self.full_finetune = settings.full_finetune
        self.device, dtype = engine_config.device, engine_config.torch_dtype
        lora = settings.lora  # None under full fine-tuning
        on_ray = (settings.placement or placement) == "ray"
        torch.manual_seed(settings.seed)  # reproducible adapter init at step 0
        self.model, self.tokenizer = base_models.load_policy(base_model, lora, dtype=dtype, device=self.device,
                                                             trainable=not settings.fsdp)
        self.lock = threading.RLock()
        self.adapters = AdapterSet(self.model)
        self.engine = LLMEngine(self.model, self.tokenizer, engine_config, lock=self.lock, adapters=self.adapters)
        self.replicas = None
        if settings.engine_replicas > 1:  # replicas 1..N-1 build the same model in processes of their own
            from art.engine.replicas import ReplicaSet, ReplicaSpec, replica_threads

            replica_class = None
            if on_ray:
                from art.ray_cluster import RayReplica as replica_class
            spec = ReplicaSpec(base_model, lora, self.engine.config, replica_threads())
            self.replicas = ReplicaSet(self.engine, spec, settings.engine_replicas, replica_class)
        peers = None
        if settings.trainer_ranks > 1 or settings.fsdp:  # ranks 1..N-1 (sharded: all N) are processes of their own
            from art.training.data_parallel import RankPeers, RankSpec

            if on_ray:
                from art.ray_cluster import RayRankPeers as RankPeers
            peers = RankPeers(settings.trainer_ranks, RankSpec(base_model, lora, str(self.device),
                                                               str(dtype).removeprefix("torch."), settings.fsdp))
        if settings.fsdp:
            from art.training.sharded import ShardedTrainer

            self.trainer = ShardedTrainer(self.model, peers, lock=self.lock, device=self.device, dtype=dtype)
        else:
            self.trainer = Trainer(self.model, self.tokenizer, lock=self.lock, device=self.device, dtype=dtype,
                                   peers=peers, load_reference=base_models.reference_loader(base_model, lora,
                                                                                            dtype=dtype,
                                                                                            device=self.device))
        self.store = CheckpointStore(self.dir.checkpoints)
        latest = self.store.latest_step()
        if latest is None:
            self.store.write(0, self.trainer.save)
            latest = 0
            self.trainer.sync_peers(self.store.path(0))
        else:
            self.trainer.restore(self.store.path(latest))
        self.step = latest
        self.adapters.live_step = latest
        if self.replicas is not None:
            self.replicas.restart(latest, self.live_weights())  # all start, on the weights of `latest`
        self._model_json = {
            "name": name, "project": project, "base_model": base_model, "config": user_config,
            "internal_config": internal, "lora": lora, "updated_at": time.time(),
        }
        forked_from = (self.dir.read_model_json() or {}).get("forked_from")  # a fork made before registering
        if forked_from is not None:
            self._model_json["forked_from"] = forked_from
        self.dir.write_model_json(self._model_json)
        self._shown_options: TrainOptions | None = None
        self._train_lock = asyncio.Lock()
        self._cancel = threading.Event()  # set by `cancel`: the running step stops and rolls back
        self._train_calls = 0  # train calls running or waiting for the training lock
        log.info("%s/%s ready at step %d", project, name, self.step)

    # -- serving ----------------------------------------------------------------------------
    def resolve(self, requested: str) -> ServedModel:
        """`name` -> latest step, `name@N` -> step N, the base model id -> no adapter."""
        if requested == self.base_model:
            if self.full_finetune:
                raise ModelNotFoundError(f"model {echo(requested)}: a fully fine-tuned model keeps no separate base "
                                         f"weights; ask for {self.name!r}")
            return ServedModel(requested, self.serving, None, 0)
        if model_part(requested) != self.name:
            raise ModelNotFoundError(f"model {echo(requested)} not found")
        _, step = parse_served_name(requested)
        if step is None:  # the engine picks the live weights when sampling starts
            return ServedModel(requested, self.serving, AdapterRef(self.name, None, None), self.step)
        if self.full_finetune and step != self.step:
            raise ModelNotFoundError(f"model {echo(requested)}: only the latest step ({self.step}) of a fully "
                                     "fine-tuned model is served")
        if step not in self.store.steps():
            raise ModelNotFoundError(
                f"model {echo(requested)}: no checkpoint for step {step} (available: {self.store.steps()})")
        return ServedModel(requested, self.serving, AdapterRef(requested, self.store.path(step), step), step)

    @property
    def serving(self):
        """The engine requests go to: the replica set when there are replicas, else the one engine."""
        return self.replicas if self.replicas is not None else self.engine

    def stats(self) -> dict:
        return {"step": self.step, **self.engine.stats(), **(self.replicas.stats() if self.replicas else {})}

    def live_weights(self):
        """What replicas load to hold the live weights: the adapter's tensors (on the CPU), or,
        fully fine-tuned, the current checkpoint's folder."""
        if self.full_finetune:
            return self.store.path(self.step)
        from peft import get_peft_model_state_dict

        with self.lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.model).items()}

    async def restart_replicas(self) -> list[int]:
        """Start the replicas that left the rotation again, on the current weights; their indices."""
        if self.replicas is None:
            return []
        async with self._train_lock:  # not while a step publishes new weights
            return await asyncio.to_thread(self.replicas.restart, self.step, self.live_weights())

    def served_names(self) -> list[str]:
        steps = [self.step] if self.full_finetune else self.store.steps()
        return [self.name] + [f"{self.name}@{s}" for s in steps]

    # -- training ---------------------------------------------------------------------------
    async def train(self, groups, options: TrainOptions, progress=None,
                    expected_step: int | None = None) -> TrainResult:
        """`progress(event)`, when given, is called from the training thread after each optimizer
        step with {"type": "gradient_step", "step", "done", "total", "metrics"}. With
        `expected_step`, a model at another step raises StepConflictError and trains nothing.
        After the update the weight-sync probe runs; a mismatch rolls the step back and raises
        WeightSyncError."""
        self.check_groups(groups)  # a 400 naming the trajectory before anything moves
        self._train_calls += 1
        try:
            return await self._train_locked(groups, options, progress, expected_step)
        finally:
            self._train_calls -= 1
            if not self._train_calls:
                self._cancel.clear()

    async def train_sft(self, trajectories, options, progress=None, expected_step: int | None = None) -> TrainResult:
        """Supervised fine-tuning (`art.training.sft`) in the same transaction as `train`: one
        call, one optimizer step per batch, one checkpoint (the step counter advances by one,
        as in ART), then the weight-sync probe. The trajectories are rendered first, so bad
        input is refused before anything moves."""
        from art.training import sft

        plan = await asyncio.to_thread(
            sft.prepare, list(trajectories), options, self.tokenizer, stop_ids=self.engine.stopping.eos_ids,
            max_tokens=getattr(self.model.config, "max_position_embeddings", None) or self.engine.max_model_len)

        def update(work, options, **kwargs):
            return sft.fit(self.trainer, work, options, **kwargs)

        self._train_calls += 1
        try:
            return await self._train_locked(plan, options, progress, expected_step, update=update)
        finally:
            self._train_calls -= 1
            if not self._train_calls:
                self._cancel.clear()

    async def _train_locked(self, groups, options: TrainOptions, progress, expected_step: int | None,
                            update=None) -> TrainResult:
        async with self._train_lock:  # one update at a time per model
            if expected_step is not None and expected_step != self.step:
                raise StepConflictError.between(f"{self.project}/{self.name}", expected_step, self.step)
            if options != self._shown_options:
                self._show_options(options)
            with tracing.span("art.train_step", {"art.model": f"{self.project}/{self.name}",
                                                 "art.step_from": self.step}) as current:
                result = await asyncio.to_thread(self._train_watched, groups, options, progress,  # context copied
                                                 update)
                probed: dict = {}  # the trainer's probe logprobs, shared by the replicas' checks
                try:
                    with tracing.span("art.train.weight_sync_probe"):
                        result.metrics.update(await weight_sync.check(self, known=probed))
                except WeightSyncError as exc:
                    log.error("%s", exc)
                    await asyncio.to_thread(self._roll_back, result.step - 1)
                    raise
                if self.replicas is not None:  # each loads the step's weights and answers the probe
                    with tracing.span("art.train.publish_to_replicas"):
                        weights = await asyncio.to_thread(self.live_weights)

                        def probe(replica):
                            return weight_sync.check(self, via=replica, known=probed)

                        result.metrics.update(await self.replicas.publish(result.step, weights, probe))
                if current is not None:
                    tracing.set_attributes(current, {"art.step": result.step, **{
                        f"art.train.{k}": v for k, v in result.metrics.items() if isinstance(v, (int, float))}})
            return result

    def check_groups(self, groups) -> None:
        """Refuse malformed training input (`art.training.validate`) with a TrajectoryError."""
        check_groups(groups, vocab_size=self.model.get_input_embeddings().num_embeddings,
                     context=getattr(self.model.config, "max_position_embeddings", None) or self.engine.max_model_len)

    def cancel(self) -> bool:
        """Stop the running (or waiting) training steps at their next micro-batch; they raise
        StepCancelledError and roll back. False when no train call is in progress."""
        if not self._train_calls:
            return False
        self._cancel.set()
        return True

    def _train_watched(self, groups, options: TrainOptions, progress=None, update=None) -> TrainResult:
        self.training_since, self.training_thread = time.monotonic(), threading.get_ident()
        try:
            return self._train(groups, options, progress, update)
        finally:
            self.training_since = self.training_thread = None

    def _roll_back(self, step: int) -> None:
        """Undo the published step: weights, optimizer and engine back to checkpoint `step`."""
        with self.engine.paused():
            self.trainer.restore(self.store.path(step))
            if self.step != step:
                self.store.delete(self.step)
            self.step = step
            self.engine.weights_updated(step)

    def _show_options(self, options: TrainOptions) -> None:
        """Print the resolved training config (every default filled in) when it changes, and
        keep it in model.json, so a run's settings are never a guess."""
        if isinstance(options, TrainOptions):
            what, key, resolved = "training", "train_options", {**options.as_dict(),
                                                                "epsilon, epsilon_high": options.clip_range()}
        else:  # SFTOptions: the per-call learning rate is reported per step instead
            what, key, resolved = "SFT", "sft_options", options.described()
        tqdm.write(f"[art] {self.project}/{self.name} {what} config: " + json.dumps(resolved, default=str))
        self._model_json.update({key: resolved, "updated_at": time.time()})
        self.dir.write_model_json(self._model_json)
        self._shown_options = options

    def _train(self, groups, options: TrainOptions, progress=None, update=None) -> TrainResult:
        """`update(work, options, desc=, on_optimizer_step=, should_stop=)` changes the weights
        and returns the metrics: the GRPO step (`Trainer.step`) unless given (SFT)."""

        def on_optimizer_step(done: int, total: int, metrics: dict) -> None:
            progress({"type": "gradient_step", "step": self.step + 1, "done": done, "total": total, "metrics": metrics})

        # Running requests finish on the old weights; new ones wait for the new weights.
        with self.engine.paused():
            out_of_memory = False
            try:
                metrics = (update or self.trainer.step)(groups, options, desc=f"train step {self.step + 1}",
                                                        on_optimizer_step=on_optimizer_step if progress else None,
                                                        should_stop=self._cancel.is_set)
                with tracing.span("art.train.checkpoint", {"art.step": self.step + 1}):
                    self.store.write(self.step + 1, self.trainer.save)
                    if self.trainer.last_trainer_logprobs:  # beside the trajectories of the step they trained on
                        write_trainer_logprobs(self.dir, self.step, self.trainer.last_trainer_logprobs)
            except torch.cuda.OutOfMemoryError as exc:
                exc.__traceback__ = None  # its frames hold the step's activations
                out_of_memory = True
            except BaseException:
                self._restore_current()
                raise
            if out_of_memory:
                self._restore_current()
                if torch.cuda.is_available():
                    cuda_graphs.empty_cache()  # never during another model's graph capture
                raise ArtValueError(
                    f"the training step ran out of GPU memory and was rolled back (the model stays at step "
                    f"{self.step} and keeps serving). Lower micro_batch_tokens (now {options.micro_batch_tokens}) "
                    f"or packed_row_tokens (now {options.packed_row_tokens}), or set gradient_checkpointing=True",
                    field="micro_batch_tokens")
            self.step += 1
            self.engine.weights_updated(self.step)
        return TrainResult(self.step, metrics)

    def _restore_current(self) -> None:
        """After a failed update: the in-memory weights may be ahead of disk; back to the saved step."""
        self.trainer.restore(self.store.path(self.step))
        self.engine.weights_updated(self.step)

    def close(self) -> None:
        """Stop the engine thread (so the weights can be freed), any replicas and trainer ranks."""
        self.engine.stop()
        if self.replicas is not None:
            self.replicas.close()
        if self.trainer.peers is not None:
            self.trainer.peers.close()

    # -- checkpoint forks ---------------------------------------------------------------------
    async def load_fork(self, plan) -> int:
        """Serve a forked checkpoint (an `art.storage.fork.ForkPlan`) as this model's step
        `plan.step`, between training steps. The weights are loaded from the source first (one
        that does not fit is refused before anything is written), copied in atomically, and
        probed like a training step's; only then is the fork recorded and this model's untrained
        step 0 dropped. On failure the model keeps its step, weights and checkpoints."""
        from art.storage.fork import drop_other_steps

        async with self._train_lock:
            if plan.done_already:
                return self.step
            previous = self.step
            await asyncio.to_thread(self._load_forked, plan)
            try:
                await weight_sync.check(self)
            except WeightSyncError:
                await asyncio.to_thread(self._roll_back, previous)
                raise
            if self.replicas is not None:
                weights = await asyncio.to_thread(self.live_weights)
                await self.replicas.publish(self.step, weights, lambda replica: weight_sync.check(self, via=replica))
            self._model_json.update(forked_from=plan.record, updated_at=time.time())
            await asyncio.to_thread(self.dir.write_model_json, self._model_json)
            await asyncio.to_thread(drop_other_steps, self.store, self.step)
            log.info("%s/%s now serves %s/%s's step %d", self.project, self.name, plan.record["project"],
                     plan.record["name"], self.step)
            return self.step

    def _load_forked(self, plan) -> None:
        from art.storage.fork import copy_checkpoint

        source = plan.source.checkpoints / f"{plan.step:04d}"
        with self.engine.paused():
            try:
                self.trainer.restore(source)
            except Exception as exc:  # another adapter shape or model: the weights in memory may be half loaded
                self._restore_current()
                raise ArtValueError(f"the checkpoint {source} does not load into {self.project}/{self.name} "
                                    f"({type(exc).__name__}: {exc})", field="from_model") from exc
            try:
                copy_checkpoint(plan, self.store)
            except BaseException:
                self._restore_current()
                raise
            self.step = plan.step
            self.engine.weights_updated(self.step)

    def delete_checkpoints(self, keep: set[int]) -> list[int]:
        deleted = []
        for step in self.store.steps():
            if step not in keep and step != self.step:
                self.store.delete(step)
                deleted.append(step)
        return deleted
