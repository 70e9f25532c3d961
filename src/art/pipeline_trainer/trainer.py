"""`PipelineTrainer`: rollouts never wait for training, and no trained group is older than a bound.

ART's 2026 API (`art.PipelineTrainer`, names and defaults as ART's). Three stages share one
event loop:

    rollout workers ──(finished groups, dated)──▶ trainer ──(publishes step N+1)──▶ engine
         ▲   start a scenario only while the policy is                │
         │   at most `max_steps_off_policy` steps behind              └─▶ evaluations (own task)

- **Sizes.** `pipeline=PipelineRuntimeConfig(...)` (ART's; `config.py`): how many rollouts run,
  how many groups a step trains, how many may wait.
- **Rollouts.** `num_rollout_workers` tasks each take the next scenario and run
  `rollout_fn(model, scenario, config)` against the engine, which keeps serving while a step
  trains (`art.service.update`). A worker starts a scenario only while the group it would
  sample could still train in time: the policy is at most `max_steps_off_policy` steps behind
  the step being formed, and fewer groups are out (running or waiting) than the steps that may
  still take it can train, so few groups are sampled only to be dropped. With `max_steps` no step
  past the last takes a group: once the groups out fill the steps left none start, and when the
  last step's batch is taken the rollouts still running are cancelled (their scenarios are not
  used up, so a later call or a resumed run samples them). Fewer than
  `queue_maxsize` finished groups wait for a batch. Groups whose rewards are all equal carry no
  signal; they are set aside as they finish and counted, so they take no place in the queue,
  and a running group counts only as the share of groups that have had signal (3 in 4 before
  any finished), so when some groups end without it others are already running in their place
  (a spare left over may be dropped).
- **Dating.** Each trajectory is dated by the steps its choices say sampled them (the server
  reports `step` on every choice), the oldest turn first (`Trajectory.initial_policy_version`),
  else by the policy when its rollout started. A group is as old as its oldest trajectory.
- **Training.** Step s trains on at least `min_batch_size` and at most `max_batch_size` finished
  groups, in scenario order. A group sampled more than `max_steps_off_policy` steps before s is
  dropped (`stale_groups="drop"`, ART's behaviour) or never arises (`"wait"`: before training,
  the trainer waits for every running rollout that would be too old after this step, and trains
  it now), and counted; so is one whose lag, averaged over its completion tokens, passes
  `limit_mean_steps_off_policy` (`mean_steps_off_policy`). The importance ratio against the
  sampler's logprobs corrects the rest of the lag.
- **Checkpoint rows.** Each saved step and each finished evaluation add a history row of ART's
  `checkpoint/*` metrics, which retention strategies are told (`CheckpointInfo`).
- **Resume.** After each step the scenarios used up and the counters are saved (`state.py`),
  with the step's checkpoint already on disk; a killed pipeline started again resumes at the
  model's step and runs again only the scenarios whose groups were not trained yet.

With `max_steps_off_policy=0, stale_groups="wait"` and as many workers as groups per step it is
the synchronous loop: the same groups, in the same order, give the same update.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Generic, Literal

from tqdm.auto import tqdm

from art.errors import TooManyExceptionsError
from art.gather import has_signal
from art.metrics_taxonomy import route
from art.observability.progress import progress_bar
from art.pipeline_trainer.admission import Gate, signal_share
from art.pipeline_trainer.broadcast import Broadcast
from art.pipeline_trainer.checkpoint_retention import (
    CHECKPOINT_CREATED_AT_METRIC,
    CHECKPOINT_SAVED_METRIC,
    CheckpointRetentionStrategy,
)
from art.pipeline_trainer.checkpoints import log_checkpoint, retain_checkpoints
from art.pipeline_trainer.config import PipelineRuntimeConfig
from art.pipeline_trainer.evaluation import Evaluations, metrics_context
from art.pipeline_trainer.keywords import ArtAttributes, resolve_keywords
from art.pipeline_trainer.rollouts import date_group, rollout_group, unused_scenarios
from art.pipeline_trainer.settings import runtime_config
from art.pipeline_trainer.signals import install_stop_signals
from art.pipeline_trainer.staleness import mean_steps_off_policy
from art.pipeline_trainer.state import STATE_KEY, PipelineState
from art.pipeline_trainer.step_metrics import FinishedGroup, Interval, step_metrics
from art.pipeline_trainer.types import ConfigT, EvalFn, RolloutFn, ScenarioT
from art.rollout_runs import cancel_all
from art.trajectories import TrajectoryGroup, completion_tokens

log = logging.getLogger(__name__)

COLLAPSE_BANNER = """
========================================
MODEL COLLAPSE DETECTED - training stopped
========================================
{count} groups in a row had rewards that were all equal: the policy may have collapsed.
- lower the learning rate;
- make sure the reward can vary within a group (graded rewards, more varied scenarios);
- raise discard_queue_multiplier (now {multiplier} x min_batch_size) to let it run on.
"""


class PipelineTrainer(ArtAttributes, Generic[ScenarioT, ConfigT]):
    """Rollouts, training and evaluation as an asynchronous pipeline (see the module docstring)."""

    def __init__(
        self,
        model,
        backend,
        rollout_fn: RolloutFn[ScenarioT, ConfigT],
        scenarios: AsyncIterator[ScenarioT] | Iterable[ScenarioT],
        config: ConfigT,
        eval_fn: EvalFn[ConfigT] | None = None,
        *,
        num_rollout_workers: int | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        queue_maxsize: int | None = None,
        pipeline: PipelineRuntimeConfig | None = None,
        autotune: object | None = None,
        learning_rate: float = 1e-5,
        loss_fn: str = "cispo",
        loss_fn_config: dict | None = None,
        normalize_advantages: bool = True,
        grad_accumulation_sequences: int | None = None,
        adam_params: object | None = None,
        kl_penalty_coef: float = 0.0,
        kl_penalty_step_lag: int | None = None,
        train_options: Mapping[str, Any] | None = None,
        max_steps: int | None = None,
        discard_queue_multiplier: int = 100,
        max_steps_off_policy: int | None = 4,
        limit_mean_steps_off_policy: float | None = None,
        stale_groups: Literal["drop", "wait"] = "drop",
        score_reference_groups_per_step: float | None = None,
        score_reference_rollouts_per_group: float | None = None,
        log_interval_seconds: float = 60.0,
        status_ewa_alpha: float = 0.2,
        total_scenarios: int | None = None,
        eval_every_n_steps: int = 20,
        eval_at_start: bool = True,
        save_checkpoint: bool = True,
        optimizer_save_interval: int = 5,
        checkpoint_retention_strategy: CheckpointRetentionStrategy | None = None,
        checkpoint_retention_interval: int = 1,
        resume: bool = True,
        rollout_executor: object | None = None,
    ) -> None:
        """`pipeline` (`PipelineRuntimeConfig`, ART's): `num_rollout_workers` scenarios run at once;
        a step trains `min_batch_size` to `max_batch_size` (default 10x min) groups; `queue_maxsize`
        finished groups may wait for a batch before workers hold off (default: one batch per step
        a group may lag, at least one batch). Passing those four to the trainer itself is ART's
        deprecated spelling (a DeprecationWarning; with `pipeline` too, an error).
        `max_steps_off_policy`: the most steps a trained group may lag the policy it trains (None:
        unbounded); `limit_mean_steps_off_policy`: the most its token-weighted mean lag may be
        (None: no limit); `stale_groups` says what happens to one past the first bound ("drop"
        it, or "wait" for it so it trains in time). `learning_rate`, `loss_fn` ("cispo" or
        "ppo"), `normalize_advantages` and `train_options` (any other `backend.train` option,
        e.g. {"epsilon_high": 5.0}) go to every step. `max_steps`: steps to train in this call.
        Training stops after `discard_queue_multiplier` x `min_batch_size` groups in a row without
        signal (collapse). Evaluation: `eval_fn(model, step, config)` every `eval_every_n_steps`
        steps (0: never) and at the start step (`eval_at_start`), logged at that step, beside
        training. Checkpoints: every step is saved (the update is one transaction);
        `save_checkpoint=False` keeps only the latest (and those an evaluation still needs);
        `checkpoint_retention_strategy` (e.g. `keep_recent_and_top()`) picks which older ones to
        delete (ART's contract), every `checkpoint_retention_interval` steps. `resume`: continue from the run's
        saved pipeline state. `log_interval_seconds`: a status line that often.
        (`status_ewa_alpha`, `grad_accumulation_sequences`, `optimizer_save_interval` and the
        `score_reference_*` settings are ART's and accepted for its code, with no effect here;
        `adam_params`/`loss_fn_config` other than None and `kl_penalty_coef` other than 0 are
        refused by `backend.train`; ART's autotuner and distributed rollout executors are not
        available: `autotune` other than off and a `rollout_executor` are refused.)"""
        sized = runtime_config(  # asked here, so that its DeprecationWarning points at the caller's line
            pipeline,
            dict(
                num_rollout_workers=num_rollout_workers,
                min_batch_size=min_batch_size,
                max_batch_size=max_batch_size,
                queue_maxsize=queue_maxsize,
            ),
        )
        resolved = resolve_keywords(
            sized,
            rollout_fn=rollout_fn,
            eval_fn=eval_fn,
            pipeline=pipeline,
            autotune=autotune,
            rollout_executor=rollout_executor,
            limit_mean_steps_off_policy=limit_mean_steps_off_policy,
            kl_penalty_coef=kl_penalty_coef,
            kl_penalty_step_lag=kl_penalty_step_lag,
            grad_accumulation_sequences=grad_accumulation_sequences,
            optimizer_save_interval=optimizer_save_interval,
            score_reference_groups_per_step=score_reference_groups_per_step,
            score_reference_rollouts_per_group=score_reference_rollouts_per_group,
            max_steps_off_policy=max_steps_off_policy,
            stale_groups=stale_groups,
            max_steps=max_steps,
            discard_queue_multiplier=discard_queue_multiplier,
            eval_every_n_steps=eval_every_n_steps,
            checkpoint_retention_interval=checkpoint_retention_interval,
            total_scenarios=total_scenarios,
            log_interval_seconds=log_interval_seconds,
        )
        self.settings, self.pipeline = resolved.settings, resolved.pipeline
        self.model, self.backend, self.config = model, backend, config
        self.rollout_fn, self.eval_fn = rollout_fn, eval_fn
        self.train_kwargs = {
            "learning_rate": learning_rate,
            "loss_fn": loss_fn,
            "loss_fn_config": loss_fn_config,
            "normalize_advantages": normalize_advantages,
            "adam_params": adam_params,
            **dict(train_options or {}),
        }
        # ART's keywords that are not settings (those are read-only properties below), under ART's names.
        self.eval_at_start, self.save_checkpoint, self.resume = eval_at_start, save_checkpoint, resume
        self.checkpoint_retention_strategy = checkpoint_retention_strategy
        self.kl_penalty_step_lag, self.optimizer_save_interval = kl_penalty_step_lag, optimizer_save_interval
        self.score_reference_groups_per_step = resolved.score_reference_groups_per_step
        self.score_reference_rollouts_per_group = resolved.score_reference_rollouts_per_group
        self._scenarios = scenarios
        self.state = PipelineState()
        self._done = False
        self._failure: BaseException | None = None
        self._changes = Broadcast()  # a new one per `train` call

    # -- the run ------------------------------------------------------------------------------
    async def train(self, *, handle_signals: bool = True) -> None:
        """Run the pipeline until the scenarios run out, `max_steps` steps are trained, the
        policy collapses or `request_stop()` (SIGINT/SIGTERM with `handle_signals`: the step
        being trained finishes and is saved first; a second signal stops at once)."""
        start = await self.model.get_step()
        self._resume_state(start)
        self._begin_call(start)
        restore = (
            install_stop_signals(asyncio.current_task(), lambda: self._done, self._stop)
            if handle_signals
            else (lambda: None)
        )
        workers = self._workers = [
            asyncio.create_task(self._worker(), name=f"rollout-worker-{i}") for i in range(self.num_rollout_workers)
        ]
        evaluators = (
            []
            if self._evals is None
            else [asyncio.create_task(self._evals.run(lambda: self._done), name="pipeline-eval")]
        )
        status = asyncio.create_task(self._status_lines(), name="pipeline-status")
        finished = False
        try:
            await self._train_steps(start)
            finished = True
        finally:
            self._stop()
            restore()
            await cancel_all(workers + [status])
            if finished:
                await asyncio.gather(*evaluators)  # what is queued is evaluated and logged
            else:
                await cancel_all(evaluators)
            self._bar.close()
            self.model.merge_state({STATE_KEY: self.state.saved()})

    def _resume_state(self, start: int) -> None:
        """Load the saved pipeline state (with `resume`) so a killed run skips what it already trained."""
        saved = (self.model.read_state() or {}).get(STATE_KEY) if self.resume else None
        self.state = PipelineState.from_saved(saved)
        if saved and self.state.training_step != start:
            log.warning(
                "the saved pipeline state is at step %d and the model at step %d: resuming at the model's step",
                self.state.training_step,
                start,
            )
        self.state.training_step = start

    def _begin_call(self, start: int) -> None:
        """Fresh counters, queues, evaluations and progress bar, so each `train` call starts clean."""
        self._done, self._failure = False, None
        self._changes = Broadcast()
        self._policy = self._next_step = start
        self._last_step = None if self.max_steps is None else start + self.max_steps - 1
        """The last step this call trains (`max_steps`); None: until the scenarios run out."""
        self._ready: list[FinishedGroup] = []
        self._running: dict[int, int] = {}  # scenario index -> policy step when its rollout started
        self._exhausted = False
        self._source = unused_scenarios(self._scenarios, self.state)
        self._source_lock = asyncio.Lock()
        self._interval = Interval()
        self._idle_since = self._interval.started  # the trainer waits for its first batch from here
        self._zero_variance_in_a_row = 0
        self._groups_with_signal = self._groups_without_signal = 0
        self._set_aside: list[TrajectoryGroup] = []
        self._waited: set[int] = set()  # scenarios the trainer waited for before the step being formed
        self._evals = self._evaluations()
        self._bar = progress_bar(total=self.max_steps, desc="pipeline", unit="step", dynamic_ncols=True)
        if self._evals is not None and self.eval_at_start and start not in self.state.completed_eval_steps:
            self._evals.schedule(start)

    def _evaluations(self) -> Evaluations | None:
        """The evaluation queue of this call (None without an `eval_fn`), woken by this call's changes."""
        if self.eval_fn is None:
            return None
        return Evaluations(
            self.model,
            self.backend,
            self.eval_fn,
            self.config,
            self.state,
            every_n_steps=self.eval_every_n_steps,
            changes=self._changes,
        )

    def request_stop(self) -> None:
        """Stop after the step being trained (workers start no new scenario)."""
        self._stop()

    def _stop(self) -> None:
        self._done = True
        self._changes.notify()

    # -- rollouts -----------------------------------------------------------------------------
    def _gate(self) -> Gate:
        return Gate(
            next_step=self._next_step,
            max_batch_size=self.max_batch_size,
            age_bound=self.settings.age_bound,
            last_step=self._last_step,
            queue_maxsize=self.queue_maxsize,
            wait_for_stale=self.stale_groups == "wait",
        )

    def _may_start(self) -> bool:
        """The admission gate (`admission.py`) on the pipeline's counts now."""
        share = signal_share(self._groups_with_signal, self._groups_without_signal)
        ready, running = [item.version for item in self._ready], list(self._running.values())
        return self._gate().may_start(self._policy, ready, running, share)

    async def _worker(self) -> None:
        try:
            while True:
                waited = time.monotonic()
                while not (self._done or self._may_start()):
                    await self._changes.wait()
                self._interval.rollout_idle_s += time.monotonic() - waited
                if self._done:
                    return
                async with self._source_lock:
                    item = None if self._exhausted else await anext(self._source, None)
                if item is None:
                    self._exhausted = True
                    self._changes.notify()
                    return
                await self._roll_out(*item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug of ours, or an interrupt: the pipeline ends with it
            self._failure = exc
            self._stop()

    async def _roll_out(self, index: int, scenario) -> None:
        started_at, version = time.monotonic(), self._policy
        self._running[index] = version
        self.state.total_scenarios_consumed += 1
        costs = metrics_context(self.model, "train")
        try:
            group = await rollout_group(self.rollout_fn, self.model, scenario, self.config)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.state.failed_rollouts += 1
            self.state.use_up(index)
            log.warning("scenario %d: the rollout failed (%s: %s); it is not trained", index, type(exc).__name__, exc)
            return
        finally:
            if costs is not None:
                costs.var.reset(costs)
            self._running.pop(index, None)
            self._changes.notify()
        elapsed = time.monotonic() - started_at
        if not group.trajectories and group.exceptions:
            first = group.exceptions[0]
            self._failure = TooManyExceptionsError(
                f"all {len(group.exceptions)} rollouts of scenario {index} failed; the first: {first.type}: "
                f"{first.message}"
            )
            self._stop()
            return
        group_version = date_group(group, version, self._policy)
        if has_signal(group):
            self._groups_with_signal += 1
            self._zero_variance_in_a_row = 0
            self._ready.append(FinishedGroup(index, group, group_version, elapsed))
        else:  # set aside at once: it would hold a place in the queue and train nothing
            self._groups_without_signal += 1
            self._zero_variance_in_a_row += 1
            self._interval.zero_variance += 1
            self.state.discarded_zero_variance_groups += 1
            self._set_aside.append(group)
            self.state.use_up(index)
        self._interval.rollout_s += elapsed
        self._interval.rollouts += len(group.trajectories)
        self._interval.completion_tokens += sum(completion_tokens(t) for t in group.trajectories)
        self._changes.notify()

    # -- training -----------------------------------------------------------------------------
    async def _train_steps(self, start: int) -> None:
        step = start
        stop_at = None if self.max_steps is None else start + self.max_steps
        while stop_at is None or step < stop_at:
            batch = await self._next_batch(step)
            if batch is None:
                break
            if step + 1 == stop_at:
                await self._cancel_leftover_rollouts()
            step = await self._train(step, batch)
        if self._failure is not None:
            raise self._failure

    async def _cancel_leftover_rollouts(self) -> None:
        """The last step's batch is taken: a rollout still running could train at no step of this
        call, so it is cancelled now rather than share the device with the last update (its
        scenario is not used up: a later call, or a resumed run, samples it again)."""
        running = len(self._running)
        await cancel_all(self._workers)
        if running:
            log.info(
                "last step: %d rollout(s) still running cancelled, as no step left could train them "
                "(their scenarios are not used up)",
                running,
            )

    async def _next_batch(self, step: int) -> list[FinishedGroup] | None:
        """The groups step `step` trains on (None: nothing more will come)."""
        bound = self.max_steps_off_policy
        while True:
            if self._failure is not None:
                raise self._failure
            if self._done:
                return None
            self._set_aside_unusable(step)
            if self._zero_variance_in_a_row >= self.collapse_after:
                tqdm.write(
                    COLLAPSE_BANNER.format(count=self._zero_variance_in_a_row, multiplier=self.discard_queue_multiplier)
                )
                self._stop()
                return None
            everything_in = self._exhausted and not self._running
            enough = len(self._ready) >= self.min_batch_size or (everything_in and self._ready)
            if enough:
                # Step `step` is being formed: a worker's gate now counts from it.
                self._next_step = max(self._next_step, step + 1)
                self._changes.notify()
                due = (  # "wait" always has a bound
                    [i for i, v in self._running.items() if v <= step - bound]
                    if self.stale_groups == "wait" and bound is not None
                    else []
                )
                if not due:
                    return self._take(step)
                self._waited.update(due)  # trained now, or they would be too old after this step
            elif everything_in:
                return None
            await self._changes.wait()

    def _set_aside_unusable(self, step: int) -> None:
        """Drop what is too old to train at `step` (with stale_groups="drop"), or whose mean lag
        passes `limit_mean_steps_off_policy`, counted and used up. (Groups whose rewards are all
        equal were set aside as they finished.)"""
        bound, limit, keep = self.max_steps_off_policy, self.limit_mean_steps_off_policy, []
        for item in self._ready:
            if (bound is not None and item.version < step - bound) or (
                limit is not None and mean_steps_off_policy(item.group, step, item.version) > limit
            ):
                self._interval.stale += 1
                self.state.discarded_stale_groups += 1
                self.state.use_up(item.index)
            else:
                keep.append(item)
        if len(keep) < len(self._ready):  # room in the queue: workers held by queue_maxsize may start
            self._changes.notify()
        self._ready = keep

    def _take(self, step: int) -> list[FinishedGroup]:
        """Up to `max_batch_size` groups, oldest scenarios first; with stale_groups="wait" every
        group that would be too old after this step is taken too. In scenario order."""
        bound = self.max_steps_off_policy
        by_index = sorted(self._ready, key=lambda item: item.index)
        must = (  # "wait" always has a bound
            [i for i in by_index if i.version <= step - bound]
            if self.stale_groups == "wait" and bound is not None
            else []
        )
        rest = [i for i in by_index if i not in must]
        batch = sorted(must + rest[: max(0, self.max_batch_size - len(must))], key=lambda item: item.index)
        taken = {id(item) for item in batch}
        self._ready = [item for item in self._ready if id(item) not in taken]
        self._interval.waited += sum(item.index in self._waited for item in batch)
        self._waited.clear()
        return batch

    async def _train(self, step: int, batch: list[FinishedGroup]) -> int:
        """Train step `step` on `batch`, log it, save the pipeline's state; the new step. The
        step's interval (`time/step_wall_s`) runs from the previous one's end to the end of this
        update; `time/step_trainer_idle_s` is the part of it after the previous step was logged,
        when the trainer waited for this batch."""
        interval = self._interval
        idle_s = time.monotonic() - self._idle_since
        groups = [item.group for item in batch]
        self._next_step = step + 1
        self._changes.notify()
        began = time.monotonic()
        result = await self.backend.train(self.model, groups, **self.train_kwargs)
        train_s = time.monotonic() - began
        self._policy = self._next_step = result.step
        self._changes.notify()
        self.state.accepted_trainable_groups += len(batch)
        for item in batch:
            self.state.use_up(item.index)
        metrics = route(result.metrics, "train")
        metrics.update(step_metrics(step, batch, interval, self.state, idle_s=idle_s, train_s=train_s))
        self._interval = Interval()  # what happens from here on belongs to the next step
        if "trained_tokens" in result.metrics:  # with time/step_trainer_s: throughput/avg_trainer_tok_per_s
            metrics["data/step_trainer_tokens"] = result.metrics["trained_tokens"]
        await self.model.log(groups, split="train", step=step, metrics=metrics)
        saved = {CHECKPOINT_SAVED_METRIC: 1.0, CHECKPOINT_CREATED_AT_METRIC: time.time()}
        await log_checkpoint(self.backend, self.model, result.step, saved)
        if self._set_aside:
            aside, self._set_aside = self._set_aside, []
            await self.model.log(aside[:50], split="discarded", step=step)
        self.state.training_step = result.step
        if self._evals is not None and self._evals.due(result.step):
            self._evals.schedule(result.step)
        self.model.merge_state({STATE_KEY: self.state.saved()})
        await retain_checkpoints(
            self.backend,
            self.model,
            result.step,
            save_checkpoint=self.save_checkpoint,
            strategy=self.checkpoint_retention_strategy,
            interval=self.checkpoint_retention_interval,
            protected=self._evals.pending if self._evals is not None else set(),
            completed_eval_steps=self.state.completed_eval_steps,
        )
        self._bar.set_postfix(self._postfix(batch, metrics), refresh=False)
        self._bar.update(result.step - step)
        self._idle_since = time.monotonic()
        return result.step

    def _postfix(self, batch: list[FinishedGroup], metrics: dict[str, float]) -> dict[str, Any]:
        rewards = [t.reward for item in batch for t in item.group.trajectories]
        return {
            "reward": round(sum(rewards) / len(rewards), 3),
            "off_policy": round(metrics["offpolicy/steps_off_policy_mean"], 2),
            "dropped": self.state.discarded_stale_groups,
            "running": len(self._running),
            "ready": len(self._ready),
        }

    async def _status_lines(self) -> None:
        while True:
            await asyncio.sleep(self.log_interval_seconds)
            total = f"/{self.total_scenarios}" if self.total_scenarios is not None else ""
            tqdm.write(
                f"[art] pipeline at step {self._policy}: {len(self._running)} rollouts running, "
                f"{len(self._ready)} groups waiting, scenarios {self.state.total_scenarios_consumed}{total}, "
                f"dropped {self.state.discarded_stale_groups} stale and "
                f"{self.state.discarded_zero_variance_groups} without signal"
            )
