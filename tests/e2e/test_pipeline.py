"""`art.PipelineTrainer` on the tiny model: the synchronous loop at staleness 0, the staleness
bound, evaluation and checkpoint retention, and a kill in the middle of a pipeline."""

import asyncio
import json
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

import art
from art.pipeline_trainer import (
    CHECKPOINT_CREATED_AT_METRIC,
    CHECKPOINT_EVAL_COMPLETED_METRIC,
    CHECKPOINT_SAVED_METRIC,
    CheckpointRetentionContext,
    PipelineRuntimeConfig,
    keep_recent_and_top,
)
from art.pipeline_trainer.trainer import mean_steps_off_policy
from art.storage.history import row_split, rows_for_split
from art.utils.trajectory_logging import read_trajectory_groups_parquet
from tests.support.fakes import make_choice

pytestmark = pytest.mark.integration


def fixed_group(scenario: int) -> art.TrajectoryGroup:
    """A group of 4 fixed trajectories for `scenario` (ids and sampler logprobs from its seed),
    rewards that differ within the group: what a deterministic rollout returns."""
    rng = random.Random(scenario)
    prompt = [rng.randrange(5, 900) for _ in range(5)]
    trajectories = []
    for i in range(4):
        completion = [rng.randrange(5, 900) for _ in range(2 + i)]
        choice = make_choice(prompt, completion, [rng.uniform(-11.0, -10.5) for _ in completion])
        trajectories.append(art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, choice],
                                           reward=float(completion[0] % 3) + 0.1 * i, metadata={"scenario": scenario}))
    return art.TrajectoryGroup(trajectories)


async def registered(path, tiny_model_path, name: str):
    backend = art.LocalBackend(path=str(path))
    model = art.TrainableModel(name=name, project="pipe", base_model=str(tiny_model_path))
    await model.register(backend)
    return backend, model


def adapter(path, name: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(path / "pipe" / "models" / name / "checkpoints" / f"{step:04d}" / "adapter_model.safetensors")


def history(path, name: str) -> list[dict]:
    return [json.loads(line) for line in (path / "pipe" / "models" / name / "history.jsonl").open()]


def train_rows(path, name: str) -> list[dict]:
    """The training steps' rows of the run's history."""
    return rows_for_split(history(path, name), "train")


async def test_staleness_zero_gives_the_synchronous_loops_update_exactly(tiny_model_path, tmp_path):
    scenarios, per_step, steps = list(range(6)), 3, 2
    backend, model = await registered(tmp_path, tiny_model_path, "sync")
    for step in range(steps):
        await model.train([fixed_group(s) for s in scenarios[step * per_step:(step + 1) * per_step]],
                          config=art.TrainConfig(learning_rate=1e-2))
    await backend.close()

    async def rollout(model, scenario, config):
        await asyncio.sleep(random.Random(scenario).uniform(0, 0.2))  # they finish out of order
        return fixed_group(scenario)

    backend, model = await registered(tmp_path, tiny_model_path, "pipeline")
    trainer = art.PipelineTrainer(model, backend, rollout, scenarios, None, max_steps_off_policy=0,
                                  stale_groups="wait", num_rollout_workers=per_step, min_batch_size=per_step,
                                  max_batch_size=per_step, learning_rate=1e-2)
    await trainer.train(handle_signals=False)
    assert await model.get_step() == steps
    await backend.close()

    sync, pipelined = adapter(tmp_path, "sync", steps), adapter(tmp_path, "pipeline", steps)
    assert sync.keys() == pipelined.keys()
    assert all(torch.equal(sync[k], pipelined[k]) for k in sync), "the pipeline's update differs from the sync loop's"
    assert not all(torch.equal(sync[k], adapter(tmp_path, "sync", 0)[k]) for k in sync)  # the steps changed it
    rows = train_rows(tmp_path, "pipeline")
    assert [row["offpolicy/steps_off_policy_max"] for row in rows] == [0.0, 0.0]
    assert [row["data/step_num_groups_trainable"] for row in rows] == [3.0, 3.0]
    assert [row["data/cum/num_groups_trainable"] for row in rows] == [3.0, 6.0]


def sampled_by(group: art.TrajectoryGroup, step: int) -> art.TrajectoryGroup:
    for trajectory in group.trajectories:
        for choice in trajectory.messages_and_choices[1:]:
            choice.step = step  # what the server reports on every choice
    return group


async def started_with_bound_1(tmp_path, tiny_model_path, name: str, rollout, scenarios, workers: int,
                               started: list[int], expected: int):
    """A pipeline of 4 steps of 2 groups, bound 1, training in the background until `expected`
    rollouts have started, then for a moment more in which any further one would start (the gate
    decides on the event loop, at once): (backend, trainer, the training task)."""
    backend, model = await registered(tmp_path, tiny_model_path, name)
    trainer = art.PipelineTrainer(model, backend, rollout, scenarios, None, max_steps_off_policy=1,
                                  num_rollout_workers=workers, min_batch_size=2, max_batch_size=2, max_steps=4,
                                  learning_rate=1e-2)
    training = asyncio.ensure_future(trainer.train(handle_signals=False))
    deadline = time.monotonic() + 120
    while len(started) < expected and not training.done():
        assert time.monotonic() < deadline, f"only {started} started"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)
    return backend, trainer, training


async def test_no_trained_group_is_older_than_the_bound_and_dropped_groups_are_counted(tiny_model_path, tmp_path):
    scenario_0_done = asyncio.Event()

    async def rollout(model, scenario, config):
        if scenario == 0:  # sampled at step 0, back after step 2: too old for any step it could join
            while await model.get_step() < 2:
                await asyncio.sleep(0.02)
            scenario_0_done.set()
            return sampled_by(fixed_group(scenario), 0)
        if scenario >= 5:  # the batch of step 2 cannot form before scenario 0 is back
            await scenario_0_done.wait()
        # The others are sampled by the newest weights: none of them is ever too old.
        return sampled_by(fixed_group(scenario), await model.get_step())

    backend, model = await registered(tmp_path, tiny_model_path, "bound")
    trainer = art.PipelineTrainer(model, backend, rollout, range(9), None, max_steps_off_policy=1,
                                  num_rollout_workers=3, min_batch_size=2, max_batch_size=2, max_steps=4,
                                  learning_rate=1e-2, eval_fn=None)
    await trainer.train(handle_signals=False)
    await backend.close()

    run = tmp_path / "pipe" / "models" / "bound"
    rows = train_rows(tmp_path, "bound")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(row["offpolicy/steps_off_policy_max"] <= 1 for row in rows)
    assert rows[-1]["discarded/cum/stale_groups"] == 1.0 and sum(r["discarded/step/stale_groups"] for r in rows) == 1
    trained = {}
    for step in range(4):
        for line in (run / "trajectories" / "train" / f"{step:04d}.jsonl").open():
            trajectory = json.loads(line)
            assert step - trajectory["initial_policy_version"] <= 1
            trained[trajectory["metadata"]["scenario"]] = step
    assert 0 not in trained and sorted(trained) == [1, 2, 3, 4, 5, 6, 7, 8]
    state = json.loads((run / "state.json").read_text())["_pipeline_trainer"]
    assert state["discarded_stale_groups"] == 1 and state["scenario_offset"] == 9 and state["training_step"] == 4


class SlowTrainer:
    """The backend with every update `delay` seconds longer: a trainer slower than the rollouts."""

    def __init__(self, backend, delay: float) -> None:
        self.backend, self.delay = backend, delay

    def __getattr__(self, name):
        return getattr(self.backend, name)

    async def train(self, *args, **kwargs):
        await asyncio.sleep(self.delay)
        return await self.backend.train(*args, **kwargs)


async def test_step_times_partition_the_run_and_idle_is_only_the_wait_for_a_batch(tiny_model_path, tmp_path):
    """Instant rollouts and a slow trainer: after the first step a batch is always waiting, so the
    trainer is never idle, and the steps' wall times add up to no more than the run's."""
    async def rollout(model, scenario, config):
        return sampled_by(fixed_group(scenario), await model.get_step())

    backend, model = await registered(tmp_path, tiny_model_path, "timing")
    delay = 0.5
    trainer = art.PipelineTrainer(model, SlowTrainer(backend, delay), rollout, range(8), None, max_steps_off_policy=2,
                                  num_rollout_workers=4, min_batch_size=2, max_batch_size=2, max_steps=3,
                                  learning_rate=1e-2)
    began = time.monotonic()
    await trainer.train(handle_signals=False)
    elapsed = time.monotonic() - began
    await backend.close()
    rows = train_rows(tmp_path, "timing")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["time/step_trainer_s"] >= delay
        assert row["time/step_wall_s"] >= row["time/step_trainer_idle_s"] + row["time/step_trainer_s"]
        assert row["throughput/trainer_busy_fraction"] == pytest.approx(
            row["time/step_trainer_s"] / row["time/step_wall_s"])
    # Idle is the wait for a batch, not the previous step's update as well.
    assert all(row["time/step_trainer_idle_s"] < delay for row in rows[1:])
    assert sum(row["time/step_wall_s"] for row in rows) <= elapsed
    assert rows[-1]["time/cum/wall_s"] == pytest.approx(sum(row["time/step_wall_s"] for row in rows))


async def test_workers_do_not_sample_groups_that_could_not_train_in_time(tiny_model_path, tmp_path):
    """Bound 1, 2 groups a step: a group sampled by policy 0 can train at step 0 or 1, so 4 are
    needed before step 0 forms; with the gate's prior (3 in 4 groups have signal) 6 may be out,
    not the 8 workers. Groups without signal are set aside as they finish and do not hold a place."""
    started: list[int] = []
    release = asyncio.Event()

    async def rollout(model, scenario, config):
        started.append(scenario)
        await release.wait()
        group = sampled_by(fixed_group(scenario), await model.get_step())
        if scenario in (1, 6):  # no signal
            for t in group.trajectories:
                t.reward = 0.5
        return group

    backend, trainer, training = await started_with_bound_1(tmp_path, tiny_model_path, "capacity", rollout,
                                                            range(12), workers=8, started=started, expected=6)
    assert sorted(started) == [0, 1, 2, 3, 4, 5]  # 4 / (3/4), not 8
    release.set()
    await asyncio.wait_for(training, timeout=120)
    await backend.close()

    rows = train_rows(tmp_path, "capacity")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(row["offpolicy/steps_off_policy_max"] <= 1 for row in rows)
    state = trainer.state
    assert state.discarded_zero_variance_groups == 2 and state.accepted_trainable_groups == 8
    assert rows[-1]["discarded/cum/stale_groups"] == state.discarded_stale_groups <= 2  # the spares, at most


async def test_a_spare_too_old_for_any_place_left_does_not_hold_one(tiny_model_path, tmp_path):
    """Bound 1, 2 groups a step, 10 workers. Policy 0 starts 6 groups (2 steps' places at the
    prior share 3 in 4); 0-3 finish and train steps 0 and 1, while 4 and 5, spares sampled by
    policy 0, still run: too old for step 2 on. They must not count, so policy 1 starts 3 groups
    for step 2 and policy 2 three for step 3 (share 7 in 8): 12 out. A gate counting them would
    start 1 and 2 (9 out), and step 2 would wait for policy 2's samples, a whole rollout later."""
    started: list[int] = []
    first, rest = asyncio.Event(), asyncio.Event()

    async def rollout(model, scenario, config):
        started.append(scenario)
        step = await model.get_step()  # the policy it samples with
        await (first if scenario < 4 else rest).wait()
        return sampled_by(fixed_group(scenario), step)

    backend, trainer, training = await started_with_bound_1(tmp_path, tiny_model_path, "spares", rollout,
                                                            range(24), workers=10, started=started, expected=6)
    assert sorted(started) == [0, 1, 2, 3, 4, 5]
    first.set()
    for _ in range(600):  # until steps 0 and 1 are trained and nothing more starts
        await asyncio.sleep(0.05)
        if trainer.state.training_step == 2 and len(started) >= 12:
            break
    await asyncio.sleep(0.5)
    assert trainer.state.training_step == 2 and sorted(started) == list(range(12)), (trainer.state.training_step, started)
    rest.set()
    await asyncio.wait_for(training, timeout=120)
    await backend.close()

    rows = train_rows(tmp_path, "spares")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(row["offpolicy/steps_off_policy_max"] <= 1 for row in rows)
    assert trainer.state.discarded_stale_groups >= 2  # 4 and 5
    assert rows[-1]["discarded/cum/stale_groups"] == trainer.state.discarded_stale_groups


async def test_groups_without_signal_are_replaced_before_they_finish(tiny_model_path, tmp_path):
    """Bound 0, 2 groups a step, every odd scenario without signal. A gate that counts running
    groups in full starts 2 per policy and a replacement only after a group ends without signal
    (2 at once at most); one that counts them at its prior share (3 in 4), 3. Once half the groups
    have been seen to end without signal, more run at once,
    so the step does not wait a whole rollout for a replacement; what is left over is dropped as
    stale and counted."""
    running, most_at_once = 0, {}

    async def rollout(model, scenario, config):
        nonlocal running
        step = await model.get_step()
        running += 1
        most_at_once[step] = max(most_at_once.get(step, 0), running)
        await asyncio.sleep(0.1)
        running -= 1
        group = sampled_by(fixed_group(scenario), step)
        if scenario % 2:  # no signal
            for t in group.trajectories:
                t.reward = 0.5
        return group

    backend, model = await registered(tmp_path, tiny_model_path, "replaced")
    trainer = art.PipelineTrainer(model, backend, rollout, range(60), None, max_steps_off_policy=0,
                                  num_rollout_workers=8, min_batch_size=2, max_batch_size=2, max_steps=4,
                                  learning_rate=1e-2)
    await trainer.train(handle_signals=False)
    await backend.close()

    assert most_at_once[0] == 3  # before any group finished: one batch and a spare (prior 3 in 4)
    assert max(most_at_once.values()) > 3, most_at_once  # the share seen (1 in 2) raises it
    rows = train_rows(tmp_path, "replaced")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(row["offpolicy/steps_off_policy_max"] == 0 for row in rows)
    state = trainer.state
    assert state.accepted_trainable_groups == 8 and state.discarded_zero_variance_groups > 0
    assert rows[-1]["discarded/cum/stale_groups"] == state.discarded_stale_groups
    finished = state.accepted_trainable_groups + state.discarded_stale_groups + state.discarded_zero_variance_groups
    assert finished <= state.total_scenarios_consumed <= finished + 8  # + those cut off by the end


@pytest.mark.parametrize("bound", [4, None])
async def test_a_run_of_max_steps_samples_no_group_that_no_step_left_could_train(tiny_model_path, tmp_path, bound):
    """Issue 45: a 2-step run sampled 11 groups that never trained. With `max_steps` no step past
    the last takes a group, so workers start at most what the steps left can use (at the gate's
    prior share, the worker count at most beyond it), start none once the last step is formed,
    and what still runs then is cancelled, not left to run beside the last update."""
    started, finished, cancelled = [], [], []

    async def rollout(model, scenario, config):
        started.append(scenario)
        try:
            await asyncio.sleep(0.05)  # fast beside a training step of the tiny model (about 1 s)
        except asyncio.CancelledError:
            cancelled.append(scenario)
            raise
        finished.append(scenario)
        return fixed_group(scenario)

    workers, per_step, steps = 4, 2, 2
    backend, model = await registered(tmp_path, tiny_model_path, f"last-step-{bound}")
    trainer = art.PipelineTrainer(model, backend, rollout, range(100), None, max_steps_off_policy=bound,
                                  num_rollout_workers=workers, min_batch_size=per_step, max_batch_size=per_step,
                                  max_steps=steps, learning_rate=1e-2)
    await trainer.train(handle_signals=False)
    assert await model.get_step() == steps
    await backend.close()

    state = trainer.state
    assert state.accepted_trainable_groups == steps * per_step
    assert len(started) <= steps * per_step + workers, (len(started), started)  # today's code: 14 and 10
    assert state.total_scenarios_consumed == len(started)
    assert set(started) == set(finished) | set(cancelled) and not set(finished) & set(cancelled)
    unused = [s for s in finished if not state.is_used(s)]  # finished, yet no step took it
    assert len(unused) <= workers, unused


async def test_evaluation_beside_training_and_checkpoint_retention(tiny_model_path, tmp_path):
    evaluated = []

    async def rollout(model, scenario, config):
        return fixed_group(scenario)

    async def evaluate(model, step, config):
        evaluated.append(step)
        group = fixed_group(100 + step)
        for t in group.trajectories:  # the best evaluation at step 2
            t.reward = 1.0 if step == 2 else 0.1
        return {"val": [group], "test": group.trajectories[:1]}

    offered: list[CheckpointRetentionContext] = []
    keep = keep_recent_and_top(recent=1, top=1)

    def strategy(context):
        offered.append(context)
        return keep(context)

    backend, model = await registered(tmp_path, tiny_model_path, "evals")
    trainer = art.PipelineTrainer(model, backend, rollout, range(12), {"k": 1}, evaluate, learning_rate=1e-2,
                                  pipeline=PipelineRuntimeConfig(num_rollout_workers=2, min_batch_size=2,
                                                                 max_batch_size=2),
                                  eval_every_n_steps=2, checkpoint_retention_strategy=strategy)
    await trainer.train(handle_signals=False)
    steps = await backend.list_checkpoints(model)
    await backend.close()

    assert sorted(evaluated) == [0, 2, 4, 6]  # the start, then every 2 steps
    rows = history(tmp_path, "evals")
    assert {row["step"] for row in rows_for_split(rows, "val")} == {0, 2, 4, 6}
    assert {row["step"] for row in rows_for_split(rows, "test")} == {0, 2, 4, 6}
    assert all("time/step_eval_s" in row for row in rows_for_split(rows, "val"))
    assert steps == [2, 6]  # the best by val/reward and the most recent (the latest, never deletable)

    # ART's checkpoint rows: one per saved step, one per finished evaluation; what a strategy is told
    saved = {row["step"]: row[CHECKPOINT_CREATED_AT_METRIC] for row in rows if row.get(CHECKPOINT_SAVED_METRIC) == 1.0}
    assert sorted(saved) == [1, 2, 3, 4, 5, 6]
    assert {row["step"] for row in rows if row.get(CHECKPOINT_EVAL_COMPLETED_METRIC) == 1.0} == {0, 2, 4, 6}
    assert all(row_split(row) is None and "split" not in row for row in rows if CHECKPOINT_SAVED_METRIC in row)
    last = {info.step: info for info in offered[-1].checkpoints}
    assert all(last[s].created_at.timestamp() == pytest.approx(saved[s]) for s in last if s in saved)
    evaluated_steps = {s for s, info in last.items() if info.is_eval_step}
    assert {s for s in last if s in (0, 2, 4)} <= evaluated_steps <= {0, 2, 4, 6}  # 6's may still run
    assert not last[max(last)].deletion_eligible  # the latest step is shown, never deletable


async def test_a_group_whose_mean_lag_passes_the_limit_is_dropped(tiny_model_path, tmp_path):
    """`limit_mean_steps_off_policy` alone (no hard bound): scenario 0, sampled at step 0 and back
    after step 2, lags 2 on average and is dropped; every trained group lags at most the limit."""
    scenario_0_done = asyncio.Event()

    async def rollout(model, scenario, config):
        if scenario == 0:
            while await model.get_step() < 2:
                await asyncio.sleep(0.02)
            scenario_0_done.set()
            return sampled_by(fixed_group(scenario), 0)
        if scenario >= 5:
            await scenario_0_done.wait()
        return sampled_by(fixed_group(scenario), await model.get_step())

    backend, model = await registered(tmp_path, tiny_model_path, "mean")
    trainer = art.PipelineTrainer(model, backend, rollout, range(12), None, max_steps_off_policy=None,
                                  limit_mean_steps_off_policy=1.5, max_steps=4, learning_rate=1e-2, eval_fn=None,
                                  pipeline=PipelineRuntimeConfig(num_rollout_workers=3, min_batch_size=2,
                                                                 max_batch_size=2))
    await trainer.train(handle_signals=False)
    await backend.close()

    rows = train_rows(tmp_path, "mean")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert rows[-1]["discarded/cum/stale_groups"] >= 1.0
    run = tmp_path / "pipe" / "models" / "mean"
    trained = set()
    for step in range(4):
        for group in read_step_groups(run, step):
            assert mean_steps_off_policy(group, step, step) <= 1.5
            trained.add(group.trajectories[0].metadata["scenario"])
    assert 0 not in trained and trainer.state.is_used(0)


def read_step_groups(run, step: int) -> list[art.TrajectoryGroup]:
    return read_trajectory_groups_parquet(run / "trajectories" / "train" / f"{step:04d}.parquet")


SCENARIOS = 20
"""Ten steps of two groups: the kill comes after step 3, with later steps training and rolling out."""
SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import art

    SCENARIOS = {scenarios}

    async def rollout(model, scenario, config):
        messages = [{"role": "user", "content": f"Pick {scenario}."}]
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=3)
        choice = completion.choices[0]
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=float(choice.token_ids[0] % 2),
                              metadata={"scenario": scenario})

    async def main(path, base_model):
        model = art.TrainableModel(name="m", project="pipe", base_model=base_model)
        backend = art.LocalBackend(path=path)
        await model.register(backend)
        print("start", await model.get_step(), flush=True)
        trainer = art.PipelineTrainer(model, backend, art.make_group_rollout_fn(rollout, n=6), range(SCENARIOS), None,
                                      num_rollout_workers=3, min_batch_size=2, max_batch_size=2, learning_rate=1e-2)
        await trainer.train()
        print("end", await model.get_step(), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""").replace("{scenarios}", str(SCENARIOS))


def test_a_pipeline_killed_mid_run_resumes_without_losing_a_completed_step(tiny_model_path, tmp_path):
    args = [sys.executable, "-c", SCRIPT, str(tmp_path), str(tiny_model_path)]
    run = tmp_path / "pipe" / "models" / "m"
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "0003").exists():  # kill while later steps train and roll out
        assert proc.poll() is None and time.monotonic() < deadline, "the pipeline ended or hung before step 3"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-1]
    before = {step: adapter(tmp_path, "m", step) for step in range(1, killed_at + 1)}

    rerun = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    words = rerun.stdout.split()
    assert words[:2] == ["start", str(killed_at)]  # every completed step is still there
    final = int(words[-1])
    for step, tensors in before.items():  # and unchanged
        assert all(torch.equal(tensors[k], adapter(tmp_path, "m", step)[k]) for k in tensors)
    trained: dict[int, set[int]] = {}
    for step in range(final):
        path = run / "trajectories" / "train" / f"{step:04d}.jsonl"
        for line in path.open() if path.exists() else []:
            trained.setdefault(json.loads(line)["metadata"]["scenario"], set()).add(step)
    state = json.loads((run / "state.json").read_text())["_pipeline_trainer"]
    assert state["scenario_offset"] == SCENARIOS and state["training_step"] == final
    # A scenario trains twice only if the kill fell between its step's checkpoint and the saved
    # state: at most the one step in progress.
    assert sum(len(steps) - 1 for steps in trained.values()) <= 2
    counted = state["accepted_trainable_groups"] + state["discarded_stale_groups"] + state[
        "discarded_zero_variance_groups"] + state["failed_rollouts"]
    assert counted >= SCENARIOS - 2 * 3  # everything was used up (the first run's in-flight ones again)


def load_pipeline_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "pipeline_tool_agent.py"
    spec = importlib.util.spec_from_file_location("pipeline_tool_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.extended  # 180-215 s, a fifth of the suite: `-m extended` runs it; in the default run the pipeline's
# mechanics are tested on the tiny model and on vLLM, and learning on the default model by the main job's test
async def test_the_pipeline_trains_the_tool_agent_on_the_default_model(tmp_path, caplog):
    """examples/pipeline_tool_agent.py, 2 steps at bound 1, then evaluated on 32 fixed problems
    (about 3 minutes). The forced call's arguments are learnt first (the sync loop: valid calls
    0.56 -> 0.97 after two updates; runs of this test, evaluated at the start too: 0.78 -> 1.00,
    reward 0.21 -> 0.28). The untrained rate is read from step 0's own episodes, every one of
    them sampled by the untrained policy: the groups trained at step 0 and those set aside for
    equal rewards (at least 32 episodes). It varies between runs, so valid calls must either
    rise by more than the noise of 32 episodes or end at a rate the untrained model does not
    reach; the rest checks the pipeline's bookkeeping."""
    example = load_pipeline_example()
    rows = await example.main(steps=2, seed=0, max_steps_off_policy=1, path=str(tmp_path), eval_problems=32,
                              eval_every_n_steps=2, eval_at_start=False)
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["data/step_num_groups_trainable"] == 4 for row in rows)
    assert all(row["offpolicy/steps_off_policy_max"] <= 1 for row in rows)
    assert all(0 < row["throughput/trainer_busy_fraction"] <= 1 for row in rows)
    run = tmp_path / "tool-agent" / "models" / "pipeline-calculator-seed0"
    history_rows = [json.loads(line) for line in (run / "history.jsonl").open()]
    evals = {row["step"]: row for row in rows_for_split(history_rows, "val")}
    assert sorted(evals) == [2], caplog.text  # a failed evaluation is only a logged warning
    step_0 = [(row, split, row[count]) for row in history_rows if row["step"] == 0
              for split, count in (("train", "data/step_num_trajectories"), ("discarded", "discarded/num_trajectories"))
              if row_split(row) == split]
    episodes = sum(n for _, _, n in step_0)
    untrained = {key: sum(row[f"{split}/{key}"] * n for row, split, n in step_0) / episodes
                 for key in ("valid_tool_call", "reward")}
    trend = {key: [round(untrained[key], 2), round(evals[2][f"val/{key}"], 2)] for key in untrained}
    print(f"pipeline tool agent, step 0's {episodes:.0f} episodes and the evaluation at step 2:", trend)
    before, after = untrained["valid_tool_call"], evals[2]["val/valid_tool_call"]
    assert episodes >= 32
    assert after >= before + 0.15 or (after >= 0.85 and after > before), trend
    assert evals[2]["val/reward"] >= untrained["reward"], trend
    state = json.loads((run / "state.json").read_text())["_pipeline_trainer"]
    assert state["training_step"] == 2 and state["accepted_trainable_groups"] == 8
