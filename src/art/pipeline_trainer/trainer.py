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
import inspect
import logging
import math
import signal
import time
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal

from tqdm.auto import tqdm

from art.errors import ArtValueError, TooManyExceptionsError
from art.gather import completion_tokens, has_signal
from art.metrics_taxonomy import route
from art.observability.progress import progress_bar
from art.pipeline_trainer.checkpoint_retention import (
    CHECKPOINT_CREATED_AT_METRIC,
    CHECKPOINT_EVAL_COMPLETED_METRIC,
    CHECKPOINT_SAVED_METRIC,
    CheckpointRetentionStrategy,
    checkpoint_infos,
    plan_checkpoint_retention,
)
from art.pipeline_trainer.config import PipelineRuntimeConfig, check_art_keywords
from art.pipeline_trainer.staleness import lag_weights, mean_steps_off_policy
from art.pipeline_trainer.state import STATE_KEY, PipelineState
from art.pipeline_trainer.types import ConfigT, EvalFn, RolloutFn, ScenarioT
from art.trajectories import Trajectory, TrajectoryGroup, policy_versions

log = logging.getLogger(__name__)

# Before groups finish, the gate assumes it has seen PRIOR_GROUPS of which PRIOR_WITH_SIGNAL had
# signal: a running group counts 3/4, so a spare one runs per batch from the start. Measured
# (benchmarks/pipeline_vs_sync.py, 60 s reward latency): with exactly one batch out, one group
# ending without signal kept the trainer idle a whole rollout (~80 s of a ~75 s step).
PRIOR_GROUPS, PRIOR_WITH_SIGNAL = 4, 3

COLLAPSE_BANNER = """
========================================
MODEL COLLAPSE DETECTED - training stopped
========================================
{count} groups in a row had rewards that were all equal: the policy may have collapsed.
- lower the learning rate;
- make sure the reward can vary within a group (graded rewards, more varied scenarios);
- raise discard_queue_multiplier (now {multiplier} x min_batch_size) to let it run on.
"""


class _Changes:
    """A broadcast: `wait()` returns at the next `notify()` (single event loop, no lock)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass
class _Finished:
    """A finished group waiting for a batch."""

    index: int
    """The scenario's position in the scenario stream."""
    group: TrajectoryGroup
    version: int
    """The policy step of its oldest turn."""
    rollout_s: float


@dataclass
class _Interval:
    """What happened from the end of one training step to the end of the next (the next step's
    `time/`, `throughput/` and `discarded/step/` metrics), as ART counts a step's wall time."""

    started: float = field(default_factory=time.monotonic)
    rollout_s: float = 0.0
    rollout_idle_s: float = 0.0
    rollouts: int = 0
    completion_tokens: int = 0
    stale: int = 0
    zero_variance: int = 0
    waited: int = 0


class PipelineTrainer(Generic[ScenarioT, ConfigT]):
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
        problems = check_art_keywords(
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
        )
        aliases = {
            name: value
            for name, value in (
                ("num_rollout_workers", num_rollout_workers),
                ("min_batch_size", min_batch_size),
                ("max_batch_size", max_batch_size),
                ("queue_maxsize", queue_maxsize),
            )
            if value is not None
        }
        if pipeline is not None and aliases:
            problems.append(
                f"{', '.join(aliases)}: Use either pipeline=PipelineRuntimeConfig(...) or deprecated "
                "direct pipeline settings, not both."
            )
        elif aliases:
            warnings.warn(
                "Direct PipelineTrainer runtime settings are deprecated; pass "
                "pipeline=PipelineRuntimeConfig(...) instead.",
                DeprecationWarning,
                stacklevel=2,
            )
        settings = pipeline if isinstance(pipeline, PipelineRuntimeConfig) else PipelineRuntimeConfig()
        num_rollout_workers = aliases.get("num_rollout_workers", settings.num_rollout_workers)
        min_batch_size = aliases.get("min_batch_size", settings.min_batch_size)
        max_batch_size = aliases.get("max_batch_size", settings.max_batch_size)
        queue_maxsize = aliases.get("queue_maxsize", settings.queue_maxsize)

        def check_int(name: str, value, low: int, none_ok: bool = False) -> None:
            if value is None and none_ok:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"{name} must be an int >= {low}{' or None' if none_ok else ''}, got {value!r}")

        check_int("num_rollout_workers", num_rollout_workers, 1)
        check_int("min_batch_size", min_batch_size, 1)
        check_int("max_batch_size", max_batch_size, 1, none_ok=True)
        check_int("max_steps_off_policy", max_steps_off_policy, 0, none_ok=True)
        check_int("queue_maxsize", queue_maxsize, 1, none_ok=True)
        check_int("max_steps", max_steps, 0, none_ok=True)
        check_int("discard_queue_multiplier", discard_queue_multiplier, 1)
        check_int("eval_every_n_steps", eval_every_n_steps, 0)
        check_int("checkpoint_retention_interval", checkpoint_retention_interval, 1)
        check_int("total_scenarios", total_scenarios, 0, none_ok=True)
        if isinstance(max_batch_size, int) and isinstance(min_batch_size, int) and max_batch_size < min_batch_size:
            problems.append(f"max_batch_size ({max_batch_size}) must be >= min_batch_size ({min_batch_size})")
        if stale_groups not in ("drop", "wait"):
            problems.append(f"stale_groups must be 'drop' or 'wait', got {stale_groups!r}")
        if stale_groups == "wait" and max_steps_off_policy is None:
            problems.append("stale_groups='wait' needs a max_steps_off_policy to wait for")
        if not (isinstance(log_interval_seconds, (int, float)) and log_interval_seconds > 0):
            problems.append(f"log_interval_seconds must be > 0, got {log_interval_seconds!r}")
        if not callable(rollout_fn):
            problems.append("rollout_fn must be an async function (model, scenario, config) -> TrajectoryGroup")
        if eval_fn is not None and not callable(eval_fn):
            problems.append("eval_fn must be an async function (model, step, config) or None")
        if problems:
            field_name = problems[0].split(" ", 1)[0].rstrip(":,")
            raise ArtValueError("invalid PipelineTrainer settings: " + "; ".join(problems), field=field_name)
        self.model, self.backend, self.rollout_fn, self.config, self.eval_fn = (
            model,
            backend,
            rollout_fn,
            config,
            eval_fn,
        )
        self.pipeline = PipelineRuntimeConfig(**{**settings.model_dump(exclude_unset=True), **aliases})
        self.num_rollout_workers = num_rollout_workers
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size if max_batch_size is not None else 10 * min_batch_size
        self.max_steps_off_policy = max_steps_off_policy
        self.limit_mean_steps_off_policy = limit_mean_steps_off_policy
        self._age_bound = (
            max_steps_off_policy
            if max_steps_off_policy is not None
            else math.ceil(limit_mean_steps_off_policy)
            if limit_mean_steps_off_policy is not None
            else None
        )
        """The lag the rollout gate plans for: the hard bound, else the mean limit rounded up."""
        self.stale_groups = stale_groups
        self.queue_maxsize = queue_maxsize or max(self.max_batch_size, (self._age_bound or 1) * self.max_batch_size)
        self.kl_penalty_step_lag = kl_penalty_step_lag
        self.optimizer_save_interval = optimizer_save_interval
        self.score_reference_groups_per_step = (
            score_reference_groups_per_step
            if score_reference_groups_per_step is not None
            else settings.score_reference_groups_per_step
        )
        self.score_reference_rollouts_per_group = (
            score_reference_rollouts_per_group
            if score_reference_rollouts_per_group is not None
            else settings.score_reference_rollouts_per_group
        )
        self.train_kwargs = {
            "learning_rate": learning_rate,
            "loss_fn": loss_fn,
            "loss_fn_config": loss_fn_config,
            "normalize_advantages": normalize_advantages,
            "adam_params": adam_params,
            **dict(train_options or {}),
        }
        self.max_steps = max_steps
        self.collapse_after = discard_queue_multiplier * min_batch_size
        self.discard_queue_multiplier = discard_queue_multiplier
        self.log_interval_seconds = float(log_interval_seconds)
        self.total_scenarios = total_scenarios
        self.eval_every_n_steps = eval_every_n_steps
        self.eval_at_start = eval_at_start
        self.save_checkpoint = save_checkpoint
        self.checkpoint_retention_strategy = checkpoint_retention_strategy
        self.checkpoint_retention_interval = checkpoint_retention_interval
        self.resume = resume
        self._scenarios = scenarios
        self.state = PipelineState()
        self._done = False

    # -- the run ------------------------------------------------------------------------------
    async def train(self, *, handle_signals: bool = True) -> None:
        """Run the pipeline until the scenarios run out, `max_steps` steps are trained, the
        policy collapses or `request_stop()` (SIGINT/SIGTERM with `handle_signals`: the step
        being trained finishes and is saved first; a second signal stops at once)."""
        start = await self.model.get_step()
        saved = (self.model.read_state() or {}).get(STATE_KEY) if self.resume else None
        self.state = PipelineState.from_saved(saved)
        if saved and self.state.training_step != start:
            log.warning(
                "the saved pipeline state is at step %d and the model at step %d: resuming at the model's step",
                self.state.training_step,
                start,
            )
        self.state.training_step = start
        self._done, self._failure = False, None
        self._changes = _Changes()
        self._policy = self._next_step = start
        self._last_step = None if self.max_steps is None else start + self.max_steps - 1
        """The last step this call trains (`max_steps`); None: until the scenarios run out."""
        self._ready: list[_Finished] = []
        self._running: dict[int, int] = {}  # scenario index -> policy step when its rollout started
        self._exhausted = False
        self._source = self._numbered(self._scenarios)
        self._source_lock = asyncio.Lock()
        self._interval = _Interval()
        self._idle_since = self._interval.started  # the trainer waits for its first batch from here
        self._zero_variance_in_a_row = 0
        self._groups_with_signal = self._groups_without_signal = 0
        self._set_aside: list[TrajectoryGroup] = []
        self._waited: set[int] = set()  # scenarios the trainer waited for before the step being formed
        self._eval_queue: asyncio.Queue[int] = asyncio.Queue()
        self._evaluating: set[int] = set()
        total = self.max_steps if self.max_steps is not None else None
        self._bar = progress_bar(total=total, desc="pipeline", unit="step", dynamic_ncols=True)
        if self.eval_fn is not None and self.eval_at_start and start not in self.state.completed_eval_steps:
            self._schedule_eval(start)
        main = asyncio.current_task()
        restore = self._install_signals(main) if handle_signals else (lambda: None)
        workers = self._workers = [
            asyncio.create_task(self._worker(), name=f"rollout-worker-{i}") for i in range(self.num_rollout_workers)
        ]
        evaluator = asyncio.create_task(self._evaluate_queued(), name="pipeline-eval")
        status = asyncio.create_task(self._status_lines(), name="pipeline-status")
        finished = False
        try:
            await self._train_steps(start)
            finished = True
        finally:
            self._stop()
            restore()
            await _cancel(workers + [status])
            if finished:
                await evaluator  # what is queued is evaluated and logged
            else:
                await _cancel([evaluator])
            self._bar.close()
            self.model.merge_state({STATE_KEY: self.state.saved()})

    def request_stop(self) -> None:
        """Stop after the step being trained (workers start no new scenario)."""
        self._stop()

    def _stop(self) -> None:
        self._done = True
        if hasattr(self, "_changes"):
            self._changes.notify()

    def _install_signals(self, main: asyncio.Task | None):
        loop, installed = asyncio.get_running_loop(), []

        def on_signal(sig: signal.Signals) -> None:
            if self._done and main is not None:  # the second one: now
                main.cancel()
                return
            tqdm.write(f"[art] {sig.name}: stopping after the current step (again to stop now)")
            self._stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
                pass

        def restore() -> None:
            for sig in installed:
                loop.remove_signal_handler(sig)

        return restore

    # -- rollouts -----------------------------------------------------------------------------
    async def _numbered(self, scenarios) -> AsyncIterator[tuple[int, Any]]:
        """(index, scenario) of every scenario not used up yet (a resumed run skips those)."""
        index = 0
        if isinstance(scenarios, AsyncIterator) or hasattr(scenarios, "__aiter__"):
            async for scenario in scenarios:
                if not self.state.is_used(index):
                    yield index, scenario
                index += 1
            return
        for scenario in scenarios:
            if not self.state.is_used(index):
                yield index, scenario
            index += 1

    def _may_start(self) -> bool:
        """A group sampled now could still train in time: the groups out (running or waiting to
        train) fill fewer places than the steps that may take it have, and fewer than
        `queue_maxsize` finished groups wait.

        A group sampled by policy p may train at steps up to p + max_steps_off_policy (and never
        past the last step of `max_steps`), each of at most `max_batch_size` groups, from the step
        being formed on. Starting more would only
        sample groups bound to be dropped, and on a shared device would take the trainer's time to
        do it. A running group counts as the share of groups that have had signal so far
        (`_signal_share`): one that ends without signal is set aside, and had nothing started in
        its place, the step would wait a whole rollout for its replacement. With a bound of 0 and
        stale_groups="wait": exactly one batch at a time, the synchronous loop."""
        if len(self._ready) >= self.queue_maxsize:
            return False
        last = self._last_step_for(self._policy)
        if last is None:
            return True
        return self._places_filled() < self._places_until(last) - 1e-9

    def _last_step_for(self, version: int) -> int | None:
        """The last step a group sampled by policy `version` may train at: `max_steps_off_policy`
        (else the mean limit rounded up) steps on, and never past the run's last step (`max_steps`:
        a group that no step left can take is not sampled). None: no bound."""
        bound, last = self._age_bound, self._last_step
        if bound is None:
            return last
        return version + bound if last is None else min(version + bound, last)

    def _places_until(self, last_step: int) -> int:
        """The places in the steps from the one being formed up to `last_step`."""
        return max(0, last_step - self._next_step + 1) * self.max_batch_size

    def _places_filled(self) -> float:
        """How many places the groups out will fill, oldest first, each in a step it is young
        enough for. A group too old for every place left fills none: it will be dropped, and
        counting it (a spare sampled a step ago, say) would leave the next step short. With
        stale_groups="wait" every group counts in full and no spare runs: an old one is waited for
        and trained, so a group started beyond the batch would have to train in it, and the batch
        size is the user's."""
        if self.stale_groups == "wait":
            return float(len(self._ready) + len(self._running))
        share = self._signal_share()
        out = sorted([(item.version, 1.0) for item in self._ready] + [(v, share) for v in self._running.values()])
        filled = 0.0
        for version, weight in out:  # deadlines rise with the version: earliest deadline first
            filled = min(filled + weight, self._places_until(self._last_step_for(version)))
        return filled

    def _signal_share(self) -> float:
        """The share of finished groups that had signal, counting PRIOR_GROUPS more of which
        PRIOR_WITH_SIGNAL had."""
        with_signal, without = self._groups_with_signal, self._groups_without_signal
        return (with_signal + PRIOR_WITH_SIGNAL) / (with_signal + without + PRIOR_GROUPS)

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
        costs = self._metrics_context("train")
        try:
            group = self.rollout_fn(self.model, scenario, self.config)
            if inspect.isawaitable(group) and not isinstance(group, TrajectoryGroup):
                group = await group
            if isinstance(group, TrajectoryGroup) and group.pending:  # built from coroutines: run them
                group = await group
            if not isinstance(group, TrajectoryGroup):
                raise TypeError(f"rollout_fn returned {type(group).__name__}, expected a TrajectoryGroup")
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
        for trajectory in group.trajectories:
            trajectory.initial_policy_version, trajectory.final_policy_version = policy_versions(
                trajectory, version, self._policy
            )
        group_version = min((t.initial_policy_version for t in group.trajectories), default=version)
        if has_signal(group):
            self._groups_with_signal += 1
            self._zero_variance_in_a_row = 0
            self._ready.append(_Finished(index, group, group_version, elapsed))
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
        await _cancel(self._workers)
        if running:
            log.info(
                "last step: %d rollout(s) still running cancelled, as no step left could train them "
                "(their scenarios are not used up)",
                running,
            )

    async def _next_batch(self, step: int) -> list[_Finished] | None:
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
                due = [] if self.stale_groups == "drop" else [i for i, v in self._running.items() if v <= step - bound]
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

    def _take(self, step: int) -> list[_Finished]:
        """Up to `max_batch_size` groups, oldest scenarios first; with stale_groups="wait" every
        group that would be too old after this step is taken too. In scenario order."""
        bound = self.max_steps_off_policy
        by_index = sorted(self._ready, key=lambda item: item.index)
        must = [i for i in by_index if self.stale_groups == "wait" and i.version <= step - bound]
        rest = [i for i in by_index if i not in must]
        batch = sorted(must + rest[: max(0, self.max_batch_size - len(must))], key=lambda item: item.index)
        taken = {id(item) for item in batch}
        self._ready = [item for item in self._ready if id(item) not in taken]
        self._interval.waited += sum(item.index in self._waited for item in batch)
        self._waited.clear()
        return batch

    async def _train(self, step: int, batch: list[_Finished]) -> int:
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
        metrics.update(self._step_metrics(step, batch, interval, idle_s, train_s))
        self._interval = _Interval()  # what happens from here on belongs to the next step
        if "trained_tokens" in result.metrics:  # with time/step_trainer_s: throughput/avg_trainer_tok_per_s
            metrics["data/step_trainer_tokens"] = result.metrics["trained_tokens"]
        await self.model.log(groups, split="train", step=step, metrics=metrics)
        await self._log_checkpoint(
            result.step, {CHECKPOINT_SAVED_METRIC: 1.0, CHECKPOINT_CREATED_AT_METRIC: time.time()}
        )
        if self._set_aside:
            aside, self._set_aside = self._set_aside, []
            await self.model.log(aside[:50], split="discarded", step=step)
        self.state.training_step = result.step
        if self._should_eval(result.step):
            self._schedule_eval(result.step)
        self.model.merge_state({STATE_KEY: self.state.saved()})
        await self._retain_checkpoints(result.step)
        self._bar.set_postfix(self._postfix(batch, metrics), refresh=False)
        self._bar.update(result.step - step)
        self._idle_since = time.monotonic()
        return result.step

    def _step_metrics(
        self, step: int, batch: list[_Finished], interval: _Interval, idle_s: float, train_s: float
    ) -> dict[str, float]:
        lags = [step - item.version for item in batch]
        weights = [pair for item in batch for pair in lag_weights(step, item.group, item.version)]
        wall = time.monotonic() - interval.started
        trajectories = sum(len(item.group.trajectories) for item in batch)
        return {
            "data/step_num_groups_trainable": float(len(batch)),
            "data/step_num_groups_submitted": float(len(batch) + interval.stale + interval.zero_variance),
            "data/step_num_trajectories": float(trajectories),
            "offpolicy/steps_off_policy_mean": sum(lags) / len(lags),
            "offpolicy/steps_off_policy_max": float(max(lags)),
            "offpolicy/token_weighted_policy_age_steps": sum(a * w for a, w in weights) / sum(w for _, w in weights),
            "offpolicy/dropped_groups": float(interval.stale),
            "offpolicy/cum/dropped_groups": float(self.state.discarded_stale_groups),
            "offpolicy/waited_groups": float(interval.waited),
            "discarded/step/stale_groups": float(interval.stale),
            "discarded/cum/stale_groups": float(self.state.discarded_stale_groups),
            "discarded/step/zero_variance_groups": float(interval.zero_variance),
            "discarded/cum/zero_variance_groups": float(self.state.discarded_zero_variance_groups),
            "time/step_wall_s": wall,
            "time/step_trainer_idle_s": idle_s,
            "time/step_backend_train_s": train_s,
            "time/step_trainer_s": train_s,
            "time/step_rollout_s": interval.rollout_s,
            "time/step_rollout_idle_s": interval.rollout_idle_s,
            "throughput/rollout_completion_tokens_per_s": interval.completion_tokens / wall if wall > 0 else 0.0,
            "throughput/rollouts_per_s": interval.rollouts / wall if wall > 0 else 0.0,
            "throughput/trainer_busy_fraction": train_s / wall if wall > 0 else 0.0,
        }

    def _postfix(self, batch: list[_Finished], metrics: dict[str, float]) -> dict[str, Any]:
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

    # -- evaluation -----------------------------------------------------------------------------
    def _should_eval(self, step: int) -> bool:
        return (
            self.eval_fn is not None
            and self.eval_every_n_steps > 0
            and step - self.state.last_eval_step >= self.eval_every_n_steps
        )

    def _schedule_eval(self, step: int) -> None:
        if step not in self._evaluating:
            self._evaluating.add(step)
            self.state.last_eval_step = step
            self._eval_queue.put_nowait(step)

    async def _evaluate_queued(self) -> None:
        """One evaluation at a time, beside training; after the last step, what is queued."""
        while not (self._done and self._eval_queue.empty()):
            if self._eval_queue.empty():
                await self._changes.wait()
                continue
            await self._evaluate(self._eval_queue.get_nowait())

    async def _evaluate(self, step: int) -> None:
        began = time.monotonic()
        try:
            costs = self._metrics_context("eval")
            try:
                result = await self.eval_fn(self.model, step, self.config)
            finally:
                if costs is not None:
                    costs.var.reset(costs)
            splits = result if isinstance(result, Mapping) else {"val": result}
            timing = {"time/step_eval_s": time.monotonic() - began}
            for split, items in splits.items():
                groups = _as_groups(items, split)
                if groups:
                    await self.model.log(groups, split=split, step=step, metrics=timing)
                    timing = None
            if timing is not None:
                await self.model.log(split="val", step=step, metrics=timing)
            await self._log_checkpoint(step, {CHECKPOINT_EVAL_COMPLETED_METRIC: 1.0})
            self.state.completed_eval_steps = sorted(set(self.state.completed_eval_steps) | {step})
            self.model.merge_state({STATE_KEY: self.state.saved()})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an evaluation never stops training
            log.warning("evaluation at step %d failed: %s: %s", step, type(exc).__name__, exc)
        finally:
            self._evaluating.discard(step)
            self._changes.notify()

    def _metrics_context(self, name: str):
        """As ART's pipeline: API costs of rollouts go to the "train" row, of evaluations to the
        "val" one (`Model.activate_metrics_context`); None for a model without it."""
        activate = getattr(self.model, "activate_metrics_context", None)
        return activate(name) if callable(activate) else None

    # -- checkpoints ----------------------------------------------------------------------------
    async def _retain_checkpoints(self, step: int) -> None:
        """Delete what `save_checkpoint=False` or the retention strategy lets go; never the latest
        step or one an evaluation still needs."""
        strategy = self.checkpoint_retention_strategy
        if self.save_checkpoint and (strategy is None or step % self.checkpoint_retention_interval):
            return
        protected = {step} | self._evaluating
        steps = await self.backend.list_checkpoints(self.model)
        eligible = [s for s in steps if s not in protected]
        if not eligible:
            return
        keep = set(steps) - set(eligible)
        if self.save_checkpoint:  # ART's contract: the strategy's plan names the steps to keep
            infos = checkpoint_infos(await self.backend.get_history(self.model), steps, self.state.completed_eval_steps)
            plan = plan_checkpoint_retention(
                current_step=step, checkpoints=infos, protected_steps=protected, strategy=strategy
            )
            if plan is None:
                return
            keep = plan.retain_steps | plan.archive_steps
        if set(steps) - keep:
            await self.backend.delete_checkpoints(self.model, keep_steps=sorted(keep))

    async def _log_checkpoint(self, step: int, metrics: dict[str, float]) -> None:
        """A history row of its own for a checkpoint fact (ART's `checkpoint/*` rows): history
        only, not W&B, and not routed under a split."""
        await self.backend.log(self.model, split="train", step=step, metrics=metrics, groups=[])


def _as_groups(items, split: str) -> list[TrajectoryGroup]:
    items = list(items or [])
    groups = [item for item in items if isinstance(item, TrajectoryGroup)]
    loose = [item for item in items if isinstance(item, Trajectory)]
    if len(groups) + len(loose) != len(items):
        raise ArtValueError(f"eval_fn's {split!r} items must be Trajectory or TrajectoryGroup objects", field="eval_fn")
    return groups + ([TrajectoryGroup(loose)] if loose else [])


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
