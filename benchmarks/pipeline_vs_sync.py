"""Wall time to reward: the synchronous loop against `art.PipelineTrainer`, on the tool agent.

    python benchmarks/pipeline_vs_sync.py [--steps 10] [--seed 0] [--max-steps-off-policy 2]
                                          [--workers 8] [--learning-rate 1e-3] [--order sync,pipeline]
                                          [--dedicated-cores] [--reward-latency 0] [--pipeline-steps N]
                                          [--path DIR] [--eager]

The task is examples/tool_agent.py's calculator agent on the default model (SmolLM2-135M-Instruct),
on CUDA when there is a GPU, else the CPU. Both runs see the same stream of problems (examples/pipeline_tool_agent.py's `problems(seed)`)
and train the same number of groups: 4 groups of 8 episodes per step whose rewards differ (a group
whose episodes all scored alike trains nothing), `--steps` steps, learning rate 1e-3, ART's
default objective (CISPO), each in a fresh `LocalBackend`, one after the other in this process.

  sync      the loop a user writes: `gather_trajectory_groups(min_groups_with_signal=4)` (more
            groups are drawn when some have no signal), then `model.train`; the engine is paused
            while a step trains, and the step's last rollouts run at low occupancy.
  pipeline  `PipelineTrainer(min_batch_size=4, max_batch_size=4, num_rollout_workers=--workers,
            max_steps_off_policy=--max-steps-off-policy)`: the engine keeps serving while a step
            trains beside it (on the CPU the cores are split while the engine has work: the engine
            keeps half; the trainer takes them all while it is idle).

On a GPU the engine and the trainer share it (the engine decodes on a CUDA stream of its own while
a step trains beside it; `--eager` turns the engine's CUDA graphs off). Two arrangements of the
2 CPU cores:

  shared (default)   the engine and the trainer share both cores: the sync loop trains on both,
                     the pipeline splits them while the engine has work. Overlap can only hide the
                     rollouts, so the training time is a floor (printed).
  --dedicated-cores  a sampler and a trainer on a core each, in both runs: one engine replica
                     process samples everything (`engine_replicas=2, dedicated_samplers=True`,
                     `ART_REPLICA_THREADS=1`) and the backend's process trains on 1 torch thread.
                     The layout of a sampler and a trainer on GPUs of their own, where the sync
                     loop leaves one of them idle at a time.

`--reward-latency S` makes every episode's reward take S more seconds, off the device (what running
an agent's tests in a sandbox or asking a judge model costs): the sync loop's device waits that long
each step, the pipeline trains meanwhile.

`--pipeline-steps N` lets the pipeline train N steps (default `--steps`): when its groups, sampled a
step or more behind, teach less each, this measures when it reaches the sync loop's final reward
anyway. "Final reward no lower" is read at the same number of groups (step `--steps`) either way.

Reward is what a step's weights earn: after each run (off the clock) every checkpoint plays the
same 96 held-out episodes (48 problems x 2, fixed seeds). The sync loop's final weights set the
target; a run reaches it at the wall time it published weights that earn as much. Printed: both
curves by step (wall time, held-out reward, and the rollouts' own reward: the mean of the last 64
episodes finished, which in the pipeline trails its weights by the steps its episodes are off
policy), the ratio pipeline / sync wall time (goal <= 0.7), both final rewards, rollout completion
tokens per second and the trainer's busy fraction (time in `train` / wall time) for each, and, on
shared cores, the bound overlap alone can reach: hiding every rollout behind training leaves at
least the sync loop's training time. Then one JSON line (the last line of stdout).

Also printed: each update's train/ratio_mean, clip fraction and (pipeline) steps off policy. The
JSON line carries every group's start, end and whether it had signal (`groups_start_end_signal`),
to read where a run waited. Runs before 2026-12-06 played 48 held-out episodes per checkpoint,
not 96. Dated runs: benchmarks/results/*-pipeline_vs_sync.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import tempfile
import time
from pathlib import Path

from _common import environment, ratio, table

import art
from art.gather import has_signal
from art.trajectories import completion_tokens

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WINDOW = 64  # episodes in a reward reading: two steps' worth
GROUPS_PER_STEP, GROUP_SIZE = 4, 8
HELD_OUT = 48  # problems, 2 episodes each: 96 held-out episodes per checkpoint (std of a mean ~0.04)


def load(name: str):
    import sys

    sys.path.insert(0, str(EXAMPLES))  # pipeline_tool_agent imports tool_agent
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool_agent = load("tool_agent")
pipeline_example = load("pipeline_tool_agent")


class Recorder:
    """Every finished episode: (seconds since start, reward, completion tokens); every finished
    group: (seconds at its start, at its end, whether its rewards differ), to read where a run waited."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.episodes: list[tuple[float, float, int]] = []
        self.groups: list[tuple[float, float, bool]] = []
        self.train_s = 0.0

    def group(self, group: art.TrajectoryGroup, started: float) -> art.TrajectoryGroup:
        now = time.monotonic() - self.start
        self.episodes += [(now, t.reward, completion_tokens(t)) for t in group.trajectories]
        self.groups.append((round(started - self.start, 1), round(now, 1), has_signal(group)))
        return group

    def reward_at(self, seconds: float) -> float | None:
        rewards = [r for t, r, _ in self.episodes if t <= seconds][-WINDOW:]
        return sum(rewards) / len(rewards) if len(rewards) >= WINDOW else None

    def time_to(self, target: float) -> float | None:
        """The first episode end at which the reward reading is >= target."""
        return next((t for t, _, _ in self.episodes if (r := self.reward_at(t)) is not None and r >= target - 1e-9),
                    None)


async def episode(model, a: int, b: int, seed: int, reward_latency: float) -> art.Trajectory:
    trajectory = await tool_agent.rollout(model, a, b, seed=seed)
    await asyncio.sleep(reward_latency)  # the reward's own wait, off the device (a sandbox, a judge)
    return trajectory


async def group_of(model, scenario, recorder: Recorder, reward_latency: float) -> art.TrajectoryGroup:
    a, b, seed = scenario
    started = time.monotonic()
    group = await art.TrajectoryGroup(episode(model, a, b, seed + 100 * i, reward_latency) for i in range(GROUP_SIZE))
    return recorder.group(group, started)


async def registered(root: str, name: str, eager: bool = False, dedicated: bool = False):
    backend = art.LocalBackend(path=root)
    internal = {"engine_args": {"enforce_eager": True}} if eager else {}
    if dedicated:  # the sampler in a process of its own; the trainer's engine only stands in
        internal |= {"engine_replicas": 2, "dedicated_samplers": True}
    model = art.TrainableModel(name=name, project="pipeline-vs-sync", base_model=art.DEFAULT_MODEL,
                               _internal_config=internal or None)
    await model.register(backend)
    return backend, model


async def run_sync(args, root: str) -> dict:
    backend, model = await registered(root, "sync", args.eager, args.dedicated_cores)
    problems, recorder, step_ends, groups_trained = pipeline_example.problems(args.seed), Recorder(), [], 0
    for step in range(args.steps):
        groups = await art.gather_trajectory_groups(
            (group_of(model, next(problems), recorder, args.reward_latency) for _ in iter(int, 1)),
            pbar_desc=f"sync step {step}", min_groups_with_signal=GROUPS_PER_STEP, max_groups=4 * GROUPS_PER_STEP)
        began = time.monotonic()
        await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
        recorder.train_s += time.monotonic() - began
        groups_trained += len(groups)
        step_ends.append(time.monotonic() - recorder.start)
    rows = [row for row in await backend.get_history(model) if any(key.startswith("train/") for key in row)]
    evals = await evaluate_steps(model, range(0, len(step_ends) + 1))
    await backend.close()
    return summary("sync", recorder, step_ends, groups_trained, evals) | {"per_step": per_step(rows)}


async def run_pipeline(args, root: str) -> dict:
    backend, model = await registered(root, "pipeline", args.eager, args.dedicated_cores)
    recorder = Recorder()

    async def rollout_fn(model, scenario, config):
        return await group_of(model, scenario, recorder, args.reward_latency)

    class Timed:
        """The backend, with the end of every training step noted."""

        def __getattr__(self, name):
            return getattr(backend, name)

        async def train(self, *args, **kwargs):
            began = time.monotonic()
            result = await backend.train(*args, **kwargs)
            recorder.train_s += time.monotonic() - began
            step_ends.append(time.monotonic() - recorder.start)
            return result

    step_ends: list[float] = []
    trainer = art.PipelineTrainer(model, Timed(), rollout_fn, pipeline_example.problems(args.seed), None,
                                  num_rollout_workers=args.workers, min_batch_size=GROUPS_PER_STEP,
                                  max_batch_size=GROUPS_PER_STEP, max_steps_off_policy=args.max_steps_off_policy,
                                  learning_rate=args.learning_rate, max_steps=args.pipeline_steps or args.steps,
                                  eval_at_start=False,
                                  log_interval_seconds=600)
    recorder.start = time.monotonic()
    await trainer.train(handle_signals=False)
    wall = time.monotonic() - recorder.start
    rows = [row for row in await backend.get_history(model) if any(key.startswith("train/") for key in row)]
    evals = await evaluate_steps(model, range(1, len(step_ends) + 1))
    await backend.close()
    out = summary("pipeline", recorder, step_ends, trainer.state.accepted_trainable_groups, evals, wall)
    out["steps_off_policy_mean"] = round(sum(r["offpolicy/steps_off_policy_mean"] for r in rows) / len(rows), 3)
    out["steps_off_policy_max"] = max(r["offpolicy/steps_off_policy_max"] for r in rows)
    out["dropped_groups"] = trainer.state.discarded_stale_groups
    out["per_step"] = per_step(rows)
    return out


def per_step(rows: list[dict]) -> dict[str, list]:
    """What each update trained on: the importance ratio against the sampler (about 1 on policy)
    and the share of clipped tokens, and (pipeline) how many steps off policy its groups were."""
    def column(key: str) -> list:
        return [None if row.get(key) is None else round(row[key], 3) for row in rows]

    return {"ratio_mean": column("train/ratio_mean"), "clip_fraction": column("train/clip_fraction"),
            "steps_off_policy_mean": column("offpolicy/steps_off_policy_mean")}


class AtStep:
    """`model` with its requests sent to the weights of checkpoint `step` (`name@step`)."""

    def __init__(self, model, step: int) -> None:
        self.model, self.step = model, step

    def __getattr__(self, name):
        return getattr(self.model, name)

    def get_inference_name(self, step: int | None = None) -> str:
        return self.model.get_inference_name(self.step if step is None else step)


async def evaluate_steps(model, steps) -> dict[int, float]:
    """Each step's weights, after the run (off the clock): mean reward on the held-out episodes,
    the same episodes and seeds for every checkpoint of both runs."""
    return {step: await evaluate(AtStep(model, step)) for step in steps}


async def evaluate(model) -> float:
    """Mean reward on HELD_OUT problems x 2 episodes, never seen in training."""
    rng = random.Random(999)
    held_out = [(rng.randint(11, 99), rng.randint(11, 99)) for _ in range(HELD_OUT)]
    episodes = await asyncio.gather(*(tool_agent.rollout(model, a, b, seed=10_000 + 7 * i + j)
                                      for i, (a, b) in enumerate(held_out) for j in range(2)))
    return sum(t.reward for t in episodes) / len(episodes)


def summary(name: str, recorder: Recorder, step_ends: list[float], groups_trained: int, evals: dict[int, float],
            wall: float | None = None) -> dict:
    wall = wall if wall is not None else step_ends[-1]
    tokens = sum(n for _, _, n in recorder.episodes)
    return {"name": name, "recorder": recorder, "step_ends": step_ends, "wall_s": round(wall, 1),
            "groups_trained": groups_trained, "episodes": len(recorder.episodes),
            "final_reward": round(recorder.reward_at(float("inf")) or 0.0, 4),
            "held_out_by_step": {step: round(r, 4) for step, r in evals.items()},
            "final_eval_reward": round(evals[len(step_ends)], 4),
            "rollout_tokens_per_s": round(tokens / wall, 1), "trainer_busy_fraction": round(recorder.train_s / wall, 3)}


def time_to(run: dict, target: float) -> float | None:
    """When `run` first published weights whose held-out reward is >= target (0: the base model)."""
    ends = [0.0, *run["step_ends"]]
    return next((round(ends[step], 1) for step, reward in sorted(run["held_out_by_step"].items())
                 if reward >= target - 1e-9), None)


def main(args: argparse.Namespace) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.dedicated_cores:
        torch.set_num_threads(1)  # the trainer (threads started later take 1 too)
        os.environ["ART_REPLICA_THREADS"] = "1"  # the sampler process
    runners = {"sync": run_sync, "pipeline": run_pipeline}
    results = {}
    with tempfile.TemporaryDirectory(prefix="art-pipeline-vs-sync-") as scratch:
        root = args.path or scratch
        for name in args.order.split(","):
            results[name] = asyncio.run(runners[name](args, root))
    sync, pipe = results["sync"], results["pipeline"]
    pipe["held_out_by_step"] = {0: sync["held_out_by_step"][0], **pipe["held_out_by_step"]}  # one base model
    # Reward is what the weights earn on held-out episodes: the sync loop's final weights set the
    # target, and a run reaches it when it publishes weights that earn as much.
    target = sync["final_eval_reward"]
    times = {r["name"]: time_to(r, target) for r in (sync, pipe)}
    time_ratio = ratio(times["pipeline"], sync["wall_s"])
    same_groups = pipe["held_out_by_step"].get(args.steps)  # the pipeline's weights after sync's number of groups
    # Secondary: the rollouts' own reward (the last WINDOW episodes finished), which in the
    # pipeline trails its weights by the steps its episodes are off policy.
    rollout_target = sync["final_reward"]
    rollout_times = {name: r["recorder"].time_to(rollout_target) for name, r in results.items()}

    print()
    steps = max(len(sync["step_ends"]), len(pipe["step_ends"]))
    cells = []
    for step in range(steps + 1):
        row = [step]
        for r in (sync, pipe):
            end = (r["step_ends"][step - 1] if step - 1 < len(r["step_ends"]) else None) if step else 0.0
            reward = r["recorder"].reward_at(end) if end else None
            held_out = r["held_out_by_step"].get(step)
            row += [None if end is None else f"{end:.0f}", None if held_out is None else f"{held_out:.3f}",
                    None if reward is None else f"{reward:.3f}"]
        cells.append(row)
    print(table(["step", "sync s", "held-out", f"rollouts({WINDOW})", "pipeline s", "held-out",
                 f"rollouts({WINDOW})"], cells))
    print()
    print(table(["step", "sync ratio", "sync clipped", "pipeline ratio", "pipeline clipped", "pipeline off policy"],
                [[step, *(r["per_step"][k][step] if step < len(r["per_step"][k]) else None
                          for r, k in ((sync, "ratio_mean"), (sync, "clip_fraction"), (pipe, "ratio_mean"),
                                       (pipe, "clip_fraction"), (pipe, "steps_off_policy_mean")))]
                 for step in range(steps)]))
    print()
    print(table(["", "wall s", "to sync's final", "final held-out", "final rollouts", "rollout tok/s",
                 "trainer busy", "groups trained"],
                [[r["name"], r["wall_s"], times[r["name"]], r["final_eval_reward"], r["final_reward"],
                  r["rollout_tokens_per_s"], r["trainer_busy_fraction"], r["groups_trained"]] for r in (sync, pipe)]))
    print(f"sync's final held-out reward {target:.3f} ({2 * HELD_OUT} episodes): the pipeline's weights reached it at "
          + ("never" if times["pipeline"] is None else f"{times['pipeline']:.0f} s")
          + f", the sync loop ended at {sync['wall_s']:.0f} s: ratio {time_ratio if time_ratio is not None else '-'}"
          " (goal <= 0.7)")
    print(f"rollout reward: sync's final {rollout_target:.3f}, the pipeline's rollouts reached it at "
          + ("never" if rollout_times["pipeline"] is None else f"{rollout_times['pipeline']:.0f} s"))
    if not args.dedicated_cores:
        print(f"the sync loop trained {sync['trainer_busy_fraction']:.0%} of its wall time: with the trainer and the"
              f" engine on the same {'GPU' if device != 'cpu' else 'cores'}, overlap alone cannot bring the ratio below"
              f" {sync['trainer_busy_fraction']:.2f}")
    if same_groups is not None and len(pipe["step_ends"]) > args.steps:
        print(f"after the same {sync['groups_trained']} groups (step {args.steps}) the pipeline's weights scored"
              f" {same_groups:.3f} held-out, the sync loop's {target:.3f}")
    print(f"pipeline: off policy {pipe['steps_off_policy_mean']} steps on average (max {pipe['steps_off_policy_max']}),"
          f" {pipe['dropped_groups']} groups dropped as stale")

    def public(r: dict) -> dict:
        return {k: v for k, v in r.items() if k not in ("recorder", "name")} | {
            "step_ends_s": [round(t, 1) for t in r["step_ends"]],
            "reward_at_step_ends": [None if (x := r["recorder"].reward_at(t)) is None else round(x, 4)
                                    for t in r["step_ends"]],
            "groups_start_end_signal": r["recorder"].groups}

    report = {
        "benchmark": "pipeline_vs_sync",
        "sync": public(sync), "pipeline": public(pipe),
        "sync_final_held_out_reward": target,
        "time_to_sync_final_held_out_reward_s": times,
        "ratio_pipeline_time_to_sync_final_over_sync_wall": time_ratio,
        "sync_final_rollout_reward": rollout_target,
        "time_to_sync_final_rollout_reward_s": rollout_times,
        "ratio_floor_from_sync_training_time": sync["trainer_busy_fraction"],
        "pipeline_held_out_at_sync_groups": same_groups,
        "goals": {"ratio_le_0_7": None if time_ratio is None else time_ratio <= 0.7,
                  "final_reward_no_lower": same_groups is not None and same_groups >= target},
        "settings": {"task": "examples/tool_agent.py", "model": art.DEFAULT_MODEL, "device": device,
                     "steps": args.steps, "groups_per_step": GROUPS_PER_STEP, "group_size": GROUP_SIZE,
                     "learning_rate": args.learning_rate, "seed": args.seed, "workers": args.workers,
                     "max_steps_off_policy": args.max_steps_off_policy, "order": args.order,
                     "pipeline_steps": args.pipeline_steps or args.steps,
                     "reward_window_episodes": WINDOW, "held_out_episodes": 2 * HELD_OUT, "objective": "cispo (ART's default)",
                     "cores": "dedicated" if args.dedicated_cores else "shared",
                     "reward_latency_s": args.reward_latency, "engine_cuda_graphs": not args.eager},
    }
    report.update(environment())
    print(json.dumps(report))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps-off-policy", type=int, default=2)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--dedicated-cores", action="store_true",
                        help="the engine and the trainer on one core each, in both runs")
    parser.add_argument("--reward-latency", type=float, default=0.0,
                        help="seconds each episode's reward takes, off the device")
    parser.add_argument("--pipeline-steps", type=int, default=None,
                        help="steps the pipeline trains (default: --steps); rewards are compared at --steps")
    parser.add_argument("--path", help="keep both runs here (default: a temporary folder)")
    parser.add_argument("--eager", action="store_true", help="CUDA: the engine without CUDA graphs")
    parser.add_argument("--order", default="sync,pipeline", help="which runs first (machine drift hits the later)")
    parsed = parser.parse_args()
    if parsed.pipeline_steps is not None and parsed.pipeline_steps < parsed.steps:
        parser.error(f"--pipeline-steps ({parsed.pipeline_steps}) must be at least --steps ({parsed.steps}):"
                     " the rewards are compared after the sync loop's number of groups")
    main(parsed)
