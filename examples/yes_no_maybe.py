"""Teach the default model to answer "maybe": a short SFT warm-up, then RL, on CPU in about a minute.

Prompts vary how they ask for "yes", "no" or "maybe". The first of those words in the reply
scores maybe 1.0, no 0.75, yes 0.5 (else 0), halved when the reply is longer than three words.

RL alone settles on "no" (0.75): the default model rarely says "maybe" first (its first-token
probability is about 0.2%), so GRPO almost never sees it rewarded, and once "No" wins no group
has a reward to compare (`--no-warmup` runs it; docs/training.md, "Exploration", has the measurements).
So the run starts with one `model.train_sft` call (step 0 -> 1, a few seconds): one one-word
reply to each of the 24 prompts, "Maybe.", "No." and "Yes." eight times each. It teaches the
format, not the answer: it says nothing about which word scores best, and leaves "maybe" first
in 12-27% of the replies. RL (learning rate 1e-3, falling linearly to 0 over the run) then finds
that "maybe" scores best and takes the mean reward to about 1.0. The run prints the mean reward
of 48 replies (each prompt twice, the same sampling seeds each time) before any training, after
the warm-up and at the end, so each part's share shows; the reward curve PNG marks them too.
Run:  python examples/yes_no_maybe.py [--steps 10] [--seed 0] [--no-warmup] [--constant-lr]
      [--dynamic-sampling] [--beta 0.04] [--dev entropy_bonus=0.05] [--otlp URL | --langfuse]
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


WARMUP_REPLIES = ("Maybe.", "No.", "Yes.")


def warmup_trajectories(seed: int) -> list[art.Trajectory]:
    """The SFT warm-up: one one-word reply to each prompt, each of WARMUP_REPLIES for a third of
    the prompts (which prompt gets which depends on `seed`). It shows the format and puts "maybe"
    among the replies; it does not say which word scores best."""
    prompts = make_prompts()
    replies = [WARMUP_REPLIES[i % len(WARMUP_REPLIES)] for i in range(len(prompts))]
    random.Random(seed).shuffle(replies)
    return [art.Trajectory(messages_and_choices=[{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": reply}], reward=0.0)
            for prompt, reply in zip(prompts, replies)]


def first_word(reply: str) -> str | None:
    return next((w for w in re.findall(r"[a-z]+", reply.lower()) if w in WORD_SCORES), None)


async def evaluate(model: art.Model, seed: int, label: str, samples: int = 2) -> tuple[float, float]:
    """Mean reward and share of replies that say "maybe" first, over `samples` replies to each
    prompt with the same sampling seeds every time (only the weights differ); logged as a "val"
    row at the model's current step."""
    rng = random.Random(seed * 10_000 - 1)
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, p, seed=rng.randrange(2**31)) for _ in range(samples))
         for p in make_prompts()),
        pbar_desc=f"eval {label}",
    )
    replies = [t for g in groups for t in g.trajectories]
    maybe = sum(first_word(t.messages_and_choices[-1].message.content or "") == "maybe" for t in replies) / len(replies)
    await model.log(groups, split="val", metrics={"maybe_first": maybe})
    return groups.stats.reward_mean, maybe


async def main(steps: int = 10, seed: int = 0, group_size: int = 8, prompts_per_step: int = 4,
               learning_rate: float = 1e-3, path: str = ".art", min_groups_with_signal: int | None = None,
               beta: float = 0.0, dev: dict | None = None, warmup: bool = True,
               warmup_learning_rate: float = 1e-3, lr_decay: bool = True) -> dict:
    """SFT warm-up (unless `warmup` is False), then `steps` RL steps, the learning rate falling
    linearly from `learning_rate` towards 0 (unless `lr_decay` is False), so that the last steps,
    at a reward near 1, only polish. Returns the evaluations `before`, `after_warmup` (None
    without the warm-up or when resumed past it) and `final`, each (mean reward, share of
    replies saying "maybe" first); `rewards`, the mean reward of each RL step this call ran; and
    `rl_steps`, the RL steps the model has had. `min_groups_with_signal`: None trains on the
    step's groups as drawn; -1 means prompts_per_step (dynamic sampling)."""
    backend = art.LocalBackend(path=path)
    name = f"maybe-seed{seed}" if warmup else f"maybe-rl-only-seed{seed}"
    model = art.TrainableModel(name=name, project="yes-no-maybe", base_model=art.DEFAULT_MODEL)
    await model.register(backend)
    prompts = make_prompts()
    run_dir = Path(path) / model.project / "models" / model.name
    curve = run_dir / "reward.png"
    print(f"reward curve (redrawn every step): {curve}")
    result: dict = {"before": None, "after_warmup": None, "final": None, "rewards": [], "rl_steps": 0}
    first_rl_step = 1 if warmup else 0
    if await model.get_step() == 0:
        result["before"] = await evaluate(model, seed, "before training")
        print(f"before any training: mean reward {result['before'][0]:.3f}, \"maybe\" first in "
              f"{result['before'][1]:.0%} of 48 replies", flush=True)
        if warmup:
            await model.train_sft(warmup_trajectories(seed), config=art.TrainSFTConfig(
                learning_rate=warmup_learning_rate, batch_size=8))
            result["after_warmup"] = await evaluate(model, seed, "after warm-up")
            print(f"after the SFT warm-up (24 one-word replies, a third \"Maybe.\"): mean reward "
                  f"{result['after_warmup'][0]:.3f}, \"maybe\" first in {result['after_warmup'][1]:.0%}",
                  flush=True)
        plot_rewards(*_history_points(run_dir))
    signal = prompts_per_step if min_groups_with_signal == -1 else min_groups_with_signal
    for step in range(await model.get_step(), first_rl_step + steps):
        rng = random.Random(seed * 10_000 + step)
        lr = learning_rate * (1 - (step - first_rl_step) / steps) if lr_decay else learning_rate
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
            await model.train(groups, config=art.TrainConfig(learning_rate=lr, beta=beta),
                              _config=dev)
        else:  # every group drawn had equal rewards: nothing to learn from, the step is only logged
            await model.log(metrics={"reward": reward, "rollouts": groups.stats.rollouts}, split="train")
        result["rewards"].append(reward)
        with_signal = sum(len({t.reward for t in g.trajectories}) > 1 for g in groups)
        print(f"RL step {step}: mean reward {reward:.3f} ({groups.stats.rollouts} rollouts, "
              f"{with_signal} groups with signal, learning rate {lr:.1e})"
              + (": every reply scored the same, nothing left to learn" if groups and not with_signal else ""),
              flush=True)
        plot_rewards(*_history_points(run_dir))  # as it goes: a killed run keeps its curve
    result["final"] = await evaluate(model, seed, "after RL")
    result["rl_steps"] = await model.get_step() - first_rl_step  # a resumed run's earlier steps too
    plot_rewards(*_history_points(run_dir))
    await backend.close()
    _summary(result)
    return result


def _summary(result: dict) -> None:
    before, warm, final, rewards = result["before"], result["after_warmup"], result["final"], result["rewards"]
    rows = [("before any training", before), ("after the SFT warm-up", warm),
            (f"after {result['rl_steps']} RL steps", final)]
    print("\nmean reward of 48 replies (each prompt twice, the same sampling seeds):")
    for label, value in rows:
        if value is not None:
            print(f"  {label:<24} {value[0]:.3f}   \"maybe\" first in {value[1]:4.0%}")
    if before is not None and final is not None:
        start = warm if warm is not None else before
        if warm is not None:
            print(f"SFT warm-up: {warm[0] - before[0]:+.3f} (one-word replies, \"maybe\" now and then); "
                  f"RL: {final[0] - start[0]:+.3f} (\"maybe\" scores best)")
        else:
            print(f"RL: {final[0] - start[0]:+.3f}")
    if len(rewards) >= 2:
        print(f"RL steps' mean reward: {' '.join(f'{r:.2f}' for r in rewards)}; "
              f"last two steps: {(rewards[-1] + rewards[-2]) / 2:.3f}")


def _history_points(run_dir: Path) -> tuple[list[tuple[int, float]], Path, str, list[tuple[int, float]], int | None]:
    """plot_rewards' arguments from the run's history (resumed runs included): the RL steps'
    rewards, the evaluations, and the step the SFT warm-up wrote (None: no warm-up)."""
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    train = sorted((row["step"], row.get("train/reward_all_rollouts", row["train/reward"]))
                   for row in rows if "train/reward" in row)
    evals = sorted((row["step"], row["val/reward"]) for row in rows if "val/reward" in row)
    warmup_step = next((row["step"] for row in rows if "sft/loss_first" in row), None)
    return train, run_dir / "reward.png", "yes/no/maybe: mean reward per step", evals, warmup_step


def plot_rewards(points: list[tuple[int, float]], out: Path, title: str = "yes/no/maybe: mean reward per step",
                 evals: list[tuple[int, float]] = (), warmup_step: int | None = None) -> None:
    """Write the reward curve to `out` (called after every step; the file is replaced atomically):
    `points`, each step's mean reward; `evals`, (step, mean reward) of evaluations, drawn as
    squares; `warmup_step`, the step an SFT warm-up ended at, shaded from the step before."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if warmup_step is not None:
        ax.axvspan(warmup_step - 1, warmup_step, color="tab:orange", alpha=0.15, label="SFT warm-up")
    ax.plot([s for s, _ in points], [r for _, r in points], marker="o", label="RL: rollouts of the step")
    if evals:
        ax.plot([s for s, _ in evals], [r for _, r in evals], "s", color="tab:green", label="eval: 48 replies")
        for s, r in evals:
            ax.annotate(f"{r:.2f}", (s, r), textcoords="offset points", xytext=(6, -12), fontsize=8, color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if warmup_step is not None or evals:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="RL steps (after the warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="RL learning rate (at the first RL step)")
    parser.add_argument("--path", default=".art")
    parser.add_argument("--no-warmup", action="store_true", help="RL alone from the base model (settles on \"no\")")
    parser.add_argument("--constant-lr", action="store_true",
                        help="keep the RL learning rate at --learning-rate (default: linear decay to 0)")
    parser.add_argument("--warmup-learning-rate", type=float, default=1e-3, help="the SFT warm-up's learning rate")
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
                     {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.dev)},
                     not args.no_warmup, args.warmup_learning_rate, not args.constant_lr))
    if args.otlp or args.langfuse:
        art.tracing.flush()
