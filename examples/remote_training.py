"""The yes/no/maybe task of examples/yes_no_maybe.py, trained on a remote `art serve`.

On the machine with the GPU (or any machine with the `backend` extra installed):

    export ART_API_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    art serve --host 0.0.0.0 --port 7999 --path ~/art-runs     # reads ART_API_KEY

On your laptop (`pip install agent-rl-trainer`: no torch needed), with the same key:

    export ART_API_KEY=...
    python examples/remote_training.py --url http://gpu-box:7999 [--steps 12]

Rollouts call the server's /v1 routes; checkpoints and history.jsonl stay on the server.
Run it again to resume where it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from pathlib import Path

import art
from yes_no_maybe import make_prompts, plot_rewards, rollout  # the task: prompts, rollout and reward


async def main(backend, *, steps: int, seed: int, group_size: int, prompts_per_step: int,
               learning_rate: float, base_model: str = art.DEFAULT_MODEL, curve: Path | None = None) -> list[float]:
    model = art.TrainableModel(name=f"maybe-seed{seed}", project="yes-no-maybe", base_model=base_model)
    await model.register(backend)  # loads the model on the server (once), at its latest step
    prompts = make_prompts()
    rewards, points = [], []
    curve = curve or Path(f"{model.name}-reward.png")  # here: the run's own files stay on the server
    print(f"reward curve of this session's steps (redrawn every step): {curve.resolve()}")
    for step in range(await model.get_step(), steps):
        rng = random.Random(seed * 10_000 + step)
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, p, seed=rng.randrange(2**31)) for _ in range(group_size))
                for p in rng.sample(prompts, prompts_per_step)
            ),
            pbar_desc=f"step {step} rollouts",
        )
        reward = sum(t.reward for g in groups for t in g.trajectories) / sum(len(g.trajectories) for g in groups)
        await model.train(groups, config=art.TrainConfig(learning_rate=learning_rate))  # streams progress
        rewards.append(reward)
        print(f"step {step}: mean reward {reward:.3f}", flush=True)
        points.append((step, reward))
        plot_rewards(points, curve)
    return rewards


async def run(url: str, **options) -> None:
    async with art.RemoteBackend(url) as backend:  # the key comes from ART_API_KEY
        await main(backend, **options)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("ART_URL", "http://127.0.0.1:7999"),
                        help="the art serve address (default $ART_URL or http://127.0.0.1:7999)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args()
    asyncio.run(run(args.url, steps=args.steps, seed=args.seed, group_size=args.group_size,
                    prompts_per_step=args.prompts_per_step, learning_rate=args.learning_rate))
