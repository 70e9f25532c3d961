"""The calculator agent of tool_agent.py, trained by `art.PipelineTrainer`: rollouts never wait for training.

The same episodes and reward as examples/tool_agent.py, but sampling and training overlap:
rollout workers keep the engine busy while a step trains beside it, and a group trains at most
`--max-steps-off-policy` steps after the policy that sampled it (older ones are dropped and
counted; the importance ratio against the sampler's logprobs corrects the rest). Every step
trains 4 groups of 8 episodes whose rewards differ; at the start and every 5 steps the policy is
evaluated on 8 fixed problems, beside training, and logged as "val".

The bound defaults to 1 here, not ART's 4: the learning rate (1e-3) moves this small model a lot
in one step, and on 2 CPU cores every group sampled ahead takes time from the trainer
(benchmarks/pipeline_vs_sync.py; docs/pipeline.md has the numbers). On this CPU the
synchronous loop of tool_agent.py is faster unless episodes wait on something off the device.

The bar shows each step's reward and how far off policy its groups were; the run's history
(`history.jsonl`, the dashboard) has `offpolicy/*`, `time/*` and `throughput/*` per step.
Stop it with Ctrl-C: the step being trained finishes and is saved, and running the script
again resumes there, skipping the problems already trained.

Run:  python examples/pipeline_tool_agent.py [--steps 10] [--seed 0] [--max-steps-off-policy 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tool_agent import rollout as episode  # noqa: E402  (the calculator episode and its reward)

import art  # noqa: E402

GROUP_SIZE = 8


def problems(seed: int):
    """An endless stream of (a, b, episode seed): the pipeline takes them as it needs them."""
    rng = random.Random(seed)
    while True:
        yield rng.randint(11, 99), rng.randint(11, 99), rng.randrange(2**31)


async def rollout_fn(model: art.TrainableModel, scenario: tuple[int, int, int], config: dict) -> art.TrajectoryGroup:
    a, b, seed = scenario
    return await art.TrajectoryGroup(episode(model, a, b, seed=seed + 100 * i) for i in range(config["group_size"]))


async def eval_fn(model: art.TrainableModel, step: int, config: dict) -> list[art.Trajectory]:
    """`config["eval_problems"]` fixed problems, one episode each, on the policy of `step`."""
    rng = random.Random(12345)
    fixed = [(rng.randint(11, 99), rng.randint(11, 99)) for _ in range(config["eval_problems"])]
    return list(await asyncio.gather(*(episode(model, a, b, seed=i) for i, (a, b) in enumerate(fixed))))


async def main(steps: int = 10, seed: int = 0, max_steps_off_policy: int = 1, learning_rate: float = 1e-3,
               path: str = ".art", eval_problems: int = 8, eval_every_n_steps: int = 5,
               eval_at_start: bool = True) -> list[dict]:
    """Train; returns the history's train rows (one per step: the trained groups' rewards, so
    mixed outcomes only; groups whose episodes all scored alike are logged as "discarded")."""
    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name=f"pipeline-calculator-seed{seed}", project="tool-agent",
                               base_model=art.DEFAULT_MODEL)
    await model.register(backend)
    start = await model.get_step()
    trainer = art.PipelineTrainer(
        model, backend, rollout_fn, problems(seed), {"group_size": GROUP_SIZE, "eval_problems": eval_problems}, eval_fn,
        # two steps' worth of groups in flight (the engine never runs dry), four groups a step
        pipeline=art.PipelineRuntimeConfig(num_rollout_workers=8, min_batch_size=4, max_batch_size=4),
        max_steps_off_policy=max_steps_off_policy,
        learning_rate=learning_rate,
        max_steps=max(0, steps - start),
        eval_every_n_steps=eval_every_n_steps,
        eval_at_start=eval_at_start,
    )
    await trainer.train()
    rows = [row for row in await backend.get_history(model) if any(key.startswith("train/") for key in row)]
    for row in rows:
        print(f"step {row['step']}: reward {row['train/reward']:.3f}  success {row['train/success']:.2f}  "
              f"off policy {row['offpolicy/steps_off_policy_mean']:.2f} (max {row['offpolicy/steps_off_policy_max']:.0f})"
              f"  trainer busy {row['throughput/trainer_busy_fraction']:.0%}  "
              f"{row['throughput/rollout_completion_tokens_per_s']:.0f} tok/s")
    evals = {row["step"]: row["val/reward"] for row in await backend.get_history(model) if "val/reward" in row}
    print("evaluation reward by step:", {step: round(reward, 3) for step, reward in sorted(evals.items())})
    await backend.close()
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps-off-policy", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.seed, args.max_steps_off_policy, args.learning_rate, args.path))
