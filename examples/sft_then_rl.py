"""Warm the default model up with SFT, then RL: on yes/no/maybe it reaches reward 0.9 sooner.

examples/yes_no_maybe.py is the RL task: the first of "yes", "no", "maybe" in the reply scores
0.5, 0.75, 1.0. RL alone settles near 0.75 ("no"): the model almost never says "maybe" first,
so GRPO never sees it rewarded. Here the model is first fine-tuned on a few hundred generated
answers to the same prompts (half "maybe", the rest "no" or "yes": a warm-up that makes "maybe"
likely, not the answer key), in one `train_sft_from_file` call (one checkpoint, step 0 -> 1),
then trained with RL exactly as in yes_no_maybe.py. `--compare` also runs RL alone and prints
how many RL steps each needed to reach a mean reward of 0.9.
Run:  python examples/sft_then_rl.py [--steps 10] [--compare] [--seed 0] [--path .art]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import art
from art.utils.sft import train_sft_from_file
from yes_no_maybe import make_prompts, rollout

TARGET = 0.9
ANSWERS = {"maybe": ["Maybe.", "maybe", "Maybe", "Maybe!"], "no": ["No.", "no", "No"], "yes": ["Yes.", "yes", "Yes"]}
SHARES = {"maybe": 0.5, "no": 0.3, "yes": 0.2}


def write_sft_file(path: Path, seed: int, per_prompt: int = 12) -> int:
    """`per_prompt` answers to each prompt, one JSONL chat row each (the ART SFT format)."""
    rng = random.Random(seed)
    rows = []
    for prompt in make_prompts():
        for _ in range(per_prompt):
            word = rng.choices(list(SHARES), weights=list(SHARES.values()))[0]
            rows.append({"messages": [{"role": "user", "content": prompt},
                                      {"role": "assistant", "content": rng.choice(ANSWERS[word])}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


async def run(backend, name: str, *, steps: int, seed: int, group_size: int, prompts_per_step: int,
              learning_rate: float, sft_file: Path | None = None, sft_lr: float = 5e-4, sft_batch_size: int = 8,
              base_model: str = art.DEFAULT_MODEL) -> list[float]:
    """RL for `steps` steps (after SFT on `sft_file` when given); the mean reward of each RL
    step's rollouts, the first measured before any RL update."""
    model = art.TrainableModel(name=name, project="yes-no-maybe", base_model=base_model)
    await model.register(backend)
    if sft_file is not None and await model.get_step() == 0:
        started = time.monotonic()
        await train_sft_from_file(model, sft_file, epochs=1, batch_size=sft_batch_size, peak_lr=sft_lr,
                                  schedule_type="cosine", warmup_ratio=0.1)
        print(f"{name}: SFT on {sft_file.name} took {time.monotonic() - started:.0f}s (now step "
              f"{await model.get_step()})", flush=True)
    prompts, rewards = make_prompts(), []
    for step in range(steps):
        rng = random.Random(seed * 10_000 + step)
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, p, seed=rng.randrange(2**31)) for _ in range(group_size))
             for p in rng.sample(prompts, prompts_per_step)),
            pbar_desc=f"{name} RL step {step}",
        )
        rewards.append(groups.stats.reward_mean)
        await model.train(groups, config=art.TrainConfig(learning_rate=learning_rate))
        print(f"{name}: RL step {step}: mean reward {rewards[-1]:.3f}", flush=True)
    return rewards


def steps_to(rewards: list[float], target: float = TARGET) -> int | None:
    """The first RL step whose rollouts averaged at least `target` (None: never)."""
    return next((i for i, r in enumerate(rewards) if r >= target), None)


async def main(path: str = ".art", steps: int = 10, seed: int = 0, group_size: int = 8, prompts_per_step: int = 4,
               learning_rate: float = 1e-3, compare: bool = False, per_prompt: int = 12, sft_lr: float = 5e-4,
               base_model: str = art.DEFAULT_MODEL) -> dict[str, list[float]]:
    backend = art.LocalBackend(path=path)
    sft_file = Path(path) / "yes-no-maybe" / f"sft-seed{seed}.jsonl"
    print(f"{write_sft_file(sft_file, seed, per_prompt)} SFT rows in {sft_file}")
    settings = dict(steps=steps, seed=seed, group_size=group_size, prompts_per_step=prompts_per_step,
                    learning_rate=learning_rate, base_model=base_model)
    curves = {"sft_then_rl": await run(backend, f"sft-then-rl-seed{seed}", sft_file=sft_file, sft_lr=sft_lr,
                                       **settings)}
    if compare:
        curves["rl_only"] = await run(backend, f"rl-only-seed{seed}", **settings)
    await backend.close()
    for arm, rewards in curves.items():
        reached = steps_to(rewards)
        print(f"{arm}: rewards {[round(r, 3) for r in rewards]}; reward >= {TARGET} at RL step "
              f"{reached if reached is not None else f'never (in {len(rewards)})'}")
    return curves


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run")
    parser.add_argument("--compare", action="store_true", help="also run RL alone from the base model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="RL learning rate")
    parser.add_argument("--sft-lr", type=float, default=5e-4, help="peak SFT learning rate (cosine, 10%% warmup)")
    parser.add_argument("--per-prompt", type=int, default=12, help="SFT answers per prompt (24 prompts)")
    parser.add_argument("--path", default=".art")
    args = parser.parse_args()
    asyncio.run(main(args.path, args.steps, args.seed, args.group_size, args.prompts_per_step, args.learning_rate,
                     args.compare, args.per_prompt, args.sft_lr))
