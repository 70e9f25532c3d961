"""Teach the default model to answer "maybe" — the main job, on CPU in a few minutes.

Prompts vary how they ask for "yes", "no" or "maybe". The first of those words in the reply
scores maybe 1.0, no 0.75, yes 0.5 (else 0), halved when the reply is longer than three words.
Run:  python examples/yes_no_maybe.py [--steps 12] [--seed 0]
      [--dynamic-sampling] [--beta 0.04] [--dev entropy_bonus=0.05] [--otlp URL | --langfuse]
The run settles on "no" (0.75): the model almost never says "maybe" first, and none of the
exploration options finds it within the run (README, "Exploration", has the measurements).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
from pathlib import Path

import art

WORD_SCORES = {"maybe": 1.0, "no": 0.75, "yes": 0.5}


def make_prompts() -> list[str]:
    prompts = []
    for words in itertools.permutations(["yes", "no", "maybe"]):
        for template in (
            "Respond with {a}, {b} or {c}.",
            "Just answer {a}, {b}, or {c}.",
            "Reply with one word: '{a}', '{b}' or '{c}'.",
            "Pick one of {a}/{b}/{c} and say only that word.",
        ):
            prompts.append(template.format(a=words[0], b=words[1], c=words[2]))
    return prompts


def score(reply: str) -> float:
    words = re.findall(r"[a-z]+", reply.lower())
    first = next((w for w in words if w in WORD_SCORES), None)
    reward = WORD_SCORES.get(first, 0.0)
    return reward / 2 if len(reply.split()) > 3 else reward


async def rollout(model: art.Model, prompt: str, seed: int) -> art.Trajectory:
    client = model.openai_client()
    messages: art.Messages = [{"role": "user", "content": prompt}]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=12, seed=seed
    )
    choice = completion.choices[0]
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=score(choice.message.content or ""))


def prompt_stream(prompts: list[str], rng: random.Random):
    """Every prompt once in a shuffled order, again and again: dynamic sampling draws from it
    until a step has enough groups with signal."""
    while True:
        order = prompts[:]
        rng.shuffle(order)
        yield from order


async def main(steps: int, seed: int, group_size: int, prompts_per_step: int, learning_rate: float, path: str,
               min_groups_with_signal: int | None = None, beta: float = 0.0, dev: dict | None = None) -> list[float]:
    """Train; returns the mean reward of every step's rollouts. `min_groups_with_signal`: None
    trains on the step's groups as drawn; -1 means prompts_per_step (dynamic sampling)."""
    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name=f"maybe-seed{seed}", project="yes-no-maybe", base_model=art.DEFAULT_MODEL)
    await model.register(backend)
    prompts = make_prompts()
    rewards = []
    run_dir = Path(path) / model.project / "models" / model.name
    curve = run_dir / "reward.png"
    print(f"reward curve (redrawn every step): {curve}")
    signal = prompts_per_step if min_groups_with_signal == -1 else min_groups_with_signal
    for step in range(await model.get_step(), steps):
        rng = random.Random(seed * 10_000 + step)
        stream = prompt_stream(prompts, rng) if signal else iter(rng.sample(prompts, prompts_per_step))
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, p, seed=rng.randrange(2**31)) for _ in range(group_size))
                for p in stream
            ),
            pbar_desc=f"step {step} rollouts",
            min_groups_with_signal=signal,
        )
        reward = groups.stats.reward_mean  # every rollout's, the groups dynamic sampling dropped too
        if groups:
            await model.train(groups, config=art.TrainConfig(learning_rate=learning_rate, beta=beta),
                              _config=dev)
        else:  # every group drawn had equal rewards: nothing to learn from, the step is only logged
            await model.log(metrics={"reward": reward, "rollouts": groups.stats.rollouts}, split="train")
        rewards.append(reward)
        with_signal = sum(len({t.reward for t in g.trajectories}) > 1 for g in groups)
        print(f"step {step}: mean reward {reward:.3f} ({groups.stats.rollouts} rollouts, "
              f"{with_signal} groups with signal)", flush=True)
        plot_rewards(_train_rewards(run_dir), curve)  # as it goes: a killed run keeps its curve
    await backend.close()
    return rewards


def _train_rewards(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mean reward of all its rollouts) of every logged step, resumed runs included."""
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    return sorted((row["step"], row.get("train/reward_all_rollouts", row["train/reward"]))
                  for row in rows if "train/reward" in row)


def plot_rewards(points: list[tuple[int, float]], out: Path, title: str = "yes/no/maybe: mean reward per step") -> None:
    """Write the reward curve to `out` (called after every step; the file is replaced atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in points], [r for _, r in points], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--path", default=".art")
    parser.add_argument("--dynamic-sampling", action="store_true",
                        help="draw more prompts until each step has --prompts-per-step groups whose rewards differ")
    parser.add_argument("--beta", type=float, default=0.0, help="KL penalty against the base model")
    parser.add_argument("--dev", action="append", default=[], metavar="NAME=JSON",
                        help="an art.dev.TrainConfig option, e.g. --dev entropy_bonus=0.01 (repeatable)")
    parser.add_argument("--otlp", metavar="URL", help="trace to an OTLP/HTTP endpoint, e.g. Phoenix's "
                        "http://127.0.0.1:6006/v1/traces (needs the tracing extra)")
    parser.add_argument("--langfuse", action="store_true",
                        help="trace to Langfuse, rewards as scores (LANGFUSE_PUBLIC_KEY/SECRET_KEY/HOST)")
    args = parser.parse_args()
    if args.otlp or args.langfuse:
        import art.tracing

        if args.otlp:
            art.tracing.configure(args.otlp)
        else:
            art.tracing.configure_langfuse()
    asyncio.run(main(args.steps, args.seed, args.group_size, args.prompts_per_step, args.learning_rate, args.path,
                     -1 if args.dynamic_sampling else None, args.beta,
                     {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.dev)}))
    if args.otlp or args.langfuse:
        art.tracing.flush()
