"""A weight update as one transaction: a step is all or nothing, on disk and in what is served.

Invariants 2 and 4 of docs/design.md hang on this module. `run_update` (train and SFT) reads top to
bottom: expected step → the engine serves beside the step (or pauses) → step → checkpoint →
`weights_updated` (publish) → probe → publish to replicas; a failure before the checkpoint
restores the saved step, a failed probe rolls the new step back. `load_fork` is the same
transaction with a forked checkpoint as the step.
Training input is checked by the caller before anything moves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from art.devices import thread_count
from art.engine import cuda_graphs
from art.errors import ArtValueError, StepConflictError, WeightSyncError
from art.observability import tracing
from art.service import probe
from art.service.api import Progress, TrainResult
from art.service.loaded import LoadedModel
from art.storage.run_log import write_trainer_logprobs
from art.training.options import TrainOptions

log = logging.getLogger(__name__)

StepFn = Callable[..., dict]
"""`step_fn(work, options, desc=, on_optimizer_step=, should_stop=)` changes the weights and
returns the metrics: `Trainer.step` (GRPO) or `LoadedModel.fit_sft`."""


async def run_update(
    loaded: LoadedModel,
    work,
    step_fn: StepFn,
    options,
    *,
    expected_step: int | None = None,
    progress: Progress | None = None,
) -> TrainResult:
    """One training step of `loaded` on `work`. `progress(event)`, when given, is called from the
    training thread after each optimizer step with {"type": "gradient_step", "step", "done",
    "total", "metrics"}. With `expected_step`, a model at another step raises StepConflictError
    and trains nothing. A probe mismatch rolls the step back and raises WeightSyncError."""
    loaded.train_calls += 1
    try:
        async with loaded.train_lock:
            if expected_step is not None and expected_step != loaded.step:
                raise StepConflictError.between(f"{loaded.project}/{loaded.name}", expected_step, loaded.step)
            if options != loaded.shown_options:
                _show_options(loaded, options)
            with tracing.span(
                "art.train_step", {"art.model": f"{loaded.project}/{loaded.name}", "art.step_from": loaded.step}
            ) as current:
                abandoned = threading.Event()
                try:  # context copied
                    result = await asyncio.to_thread(_step, loaded, work, step_fn, options, progress, abandoned)
                except asyncio.CancelledError:  # Ctrl-C, a failed script, a server's shutdown: nobody waits for
                    abandoned.set()  # the step any more; it stops at its next micro-batch and rolls back
                    raise
                result.metrics.update(await _probe_and_publish(loaded, rollback_to=result.step - 1))
                if current is not None:
                    tracing.set_attributes(
                        current,
                        {
                            "art.step": result.step,
                            **{f"art.train.{k}": v for k, v in result.metrics.items() if isinstance(v, (int, float))},
                        },
                    )
            return result
    finally:
        loaded.train_calls -= 1
        if not loaded.train_calls:
            loaded.cancelled.clear()


async def load_fork(loaded: LoadedModel, plan) -> int:
    """Serve a forked checkpoint (an `art.storage.fork.ForkPlan`) as `loaded`'s step `plan.step`,
    between training steps. The weights are loaded from the source first (one that does not fit
    is refused before anything is written), copied in atomically, and probed like a training
    step's; only then is the fork recorded and the untrained step 0 dropped. On failure the
    model keeps its step, weights and checkpoints."""
    from art.storage.fork import drop_other_steps

    async with loaded.train_lock:
        if plan.done_already:
            return loaded.step
        previous = loaded.step
        await asyncio.to_thread(_load_forked, loaded, plan)
        await _probe_and_publish(loaded, rollback_to=previous)
        loaded.model_json.update(forked_from=plan.record, updated_at=time.time())
        await asyncio.to_thread(loaded.dir.write_model_json, loaded.model_json)
        await asyncio.to_thread(drop_other_steps, loaded.store, loaded.step)
        log.info(
            "%s/%s now serves %s/%s's step %d",
            loaded.project,
            loaded.name,
            plan.record["project"],
            plan.record["name"],
            loaded.step,
        )
        return loaded.step


def _step(
    loaded: LoadedModel, work, step_fn: StepFn, options, progress, abandoned: threading.Event | None = None
) -> TrainResult:
    """Pause → step → checkpoint → `weights_updated`; on any failure, back to the saved step.
    The watchdog sees it running (`training_since`, `training_thread`)."""

    def on_optimizer_step(done: int, total: int, metrics: dict) -> None:
        progress({"type": "gradient_step", "step": loaded.step + 1, "done": done, "total": total, "metrics": metrics})

    loaded.training_since, loaded.training_thread = time.monotonic(), threading.get_ident()
    try:
        with _beside_the_engine(loaded):
            out_of_memory = False
            try:
                metrics = step_fn(
                    work,
                    options,
                    desc=_bar_label(loaded.step, options),
                    on_optimizer_step=on_optimizer_step if progress else None,
                    should_stop=_before_each_micro_batch(loaded, abandoned),
                )
                with tracing.span("art.train.checkpoint", {"art.step": loaded.step + 1}):
                    loaded.store.write(loaded.step + 1, loaded.trainer.save)
                    if loaded.trainer.last_trainer_logprobs:  # beside the trajectories of the step they trained on
                        write_trainer_logprobs(loaded.dir, loaded.step, loaded.trainer.last_trainer_logprobs)
            except torch.cuda.OutOfMemoryError as exc:
                exc.__traceback__ = None  # its frames hold the step's activations
                out_of_memory = True
            except BaseException:
                _restore_saved(loaded)
                raise
            if out_of_memory:
                _restore_saved(loaded)
                if torch.cuda.is_available():
                    cuda_graphs.empty_cache()  # never during another model's graph capture
                raise ArtValueError(
                    f"the training step ran out of GPU memory and was rolled back (the model stays at step "
                    f"{loaded.step} and keeps serving). Lower micro_batch_tokens (now {options.micro_batch_tokens}) "
                    f"or packed_row_tokens (now {options.packed_row_tokens}), or set gradient_checkpointing=True",
                    field="micro_batch_tokens",
                )
            loaded.step += 1
            loaded.publish_step()
        return TrainResult(loaded.step, metrics)
    finally:
        loaded.training_since = loaded.training_thread = None


def _bar_label(step: int, options) -> str:
    """The trainer's bar names the step the way history does: an RL step's rows are filed under
    the step that sampled its groups (the one it trains from), SFT's under the step it writes."""
    return f"train step {step}" if isinstance(options, TrainOptions) else f"sft step {step + 1}"


@contextmanager
def _beside_the_engine(loaded: LoadedModel) -> Iterator[None]:
    """How a step and the engine share the device. Serving while training: the engine answers
    from the last published weights meanwhile (on the CPU it keeps its share of the cores,
    `thread_split`), and `weights_updated` publishes the step when it lands; requests running
    then finish on the weights they started with. Otherwise the engine is paused: running
    requests finish, new ones wait for the new weights."""
    if not loaded.serve_while_training:
        with loaded.engine.paused():
            yield
        return
    engine_threads, _ = loaded.thread_split or (None, None)
    with loaded.engine.serving_while_training(engine_threads), thread_count(torch.get_num_threads()):
        yield


def _before_each_micro_batch(loaded: LoadedModel, abandoned: threading.Event | None = None) -> Callable[[], bool]:
    """The trainer's poll before each micro-batch: whether to stop (the step was cancelled, or
    `abandoned` by its caller) and, on the CPU beside a serving engine, its share of the cores
    for the next micro-batch: all of them while the engine is idle (the sync loop: nobody
    samples during its step), its `thread_split` share while the engine has requests (the pipeline)."""
    split = loaded.thread_split if loaded.serve_while_training else None

    def stop() -> bool:
        return loaded.cancelled.is_set() or (abandoned is not None and abandoned.is_set())

    if split is None:
        return stop
    everything = torch.get_num_threads()

    def poll() -> bool:
        wanted = split[1] if loaded.engine.has_work() else everything
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        return stop()

    return poll


def _load_forked(loaded: LoadedModel, plan) -> None:
    """Pause → the forked weights → their checkpoint → `weights_updated`; on failure, back to the saved step."""
    from art.storage.fork import copy_checkpoint

    source = plan.source.checkpoints / f"{plan.step:04d}"
    with loaded.engine.paused():
        try:
            loaded.trainer.restore(source)
        except Exception as exc:  # another adapter shape or model: the weights in memory may be half loaded
            _restore_saved(loaded)
            raise ArtValueError(
                f"the checkpoint {source} does not load into {loaded.project}/{loaded.name} "
                f"({type(exc).__name__}: {exc})",
                field="from_model",
            ) from exc
        try:
            copy_checkpoint(plan, loaded.store)
        except BaseException:
            _restore_saved(loaded)
            raise
        loaded.step = plan.step
        loaded.publish_step()


async def _probe_and_publish(loaded: LoadedModel, *, rollback_to: int) -> dict:
    """Probe → publish to the replicas (each loads the weights and answers the probe); a probe
    mismatch rolls back to checkpoint `rollback_to` and raises WeightSyncError. The metrics."""
    probed: dict = {}  # the trainer's probe logprobs, shared by the replicas' checks
    try:
        with tracing.span("art.train.weight_sync_probe"):
            metrics = await probe.check(loaded, known=probed)
    except WeightSyncError as exc:
        log.error("%s", exc)
        await asyncio.to_thread(_roll_back, loaded, rollback_to)
        raise
    if loaded.replicas is not None:
        with tracing.span("art.train.publish_to_replicas"):
            weights = await asyncio.to_thread(loaded.live_weights)

            def check_replica(replica):
                return probe.check(loaded, via=replica, known=probed)

            metrics.update(await loaded.replicas.publish(loaded.step, weights, check_replica))
    return metrics


def _roll_back(loaded: LoadedModel, step: int) -> None:
    """Undo the published step: weights, optimizer and engine back to checkpoint `step`."""
    with loaded.engine.paused():
        loaded.trainer.restore(loaded.store.path(step))
        if loaded.step != step:
            loaded.store.delete(loaded.step)
        loaded.step = step
        loaded.publish_step()


def _restore_saved(loaded: LoadedModel) -> None:
    """After a failed update: the in-memory weights may be ahead of disk; back to the saved step."""
    loaded.trainer.restore(loaded.store.path(loaded.step))
    loaded.publish_step()


def _show_options(loaded: LoadedModel, options) -> None:
    """Print the resolved training config (every default filled in) when it changes, and
    keep it in model.json, so a run's settings are never a guess."""
    if isinstance(options, TrainOptions):
        what, key = "training", "train_options"
    else:  # SFTOptions: the per-call learning rate is reported per step instead
        what, key = "SFT", "sft_options"
    resolved = options.described()
    tqdm.write(f"[art] {loaded.project}/{loaded.name} {what} config: " + json.dumps(resolved, default=str))
    loaded.model_json.update({key: resolved, "updated_at": time.time()})
    loaded.dir.write_model_json(loaded.model_json)
    loaded.shown_options = options
