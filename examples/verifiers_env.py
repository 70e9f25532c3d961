"""Train the default model on a `verifiers` environment, unchanged: its dataset, its rubric.

The environment is a plain `vf.SingleTurnEnv` built in memory, on the task of
`examples/yes_no_maybe.py`: prompts that ask for "yes", "no" or "maybe" in varied words, and a `vf.Rubric` of two weighted reward functions (the first of
those words in the reply scores maybe 1.0, no 0.75, yes 0.5; half of it only counts when the
reply is at most three words) plus two metrics (`num_words`, and `sampled_tokens`, the
completion tokens the server reported for the rollout). `art.verifiers` runs each group with
`env.run_group`, so the rubric scores it, and hands back trajectories whose assistant turns are
the Choices the server sampled: what trains is the sampler's exact token ids, not re-tokenised
text. Each step prints the mean reward and how many of the sampled tokens are kept as the
sampler's own ids.

Measured on the shared 2-core CPU (defaults: 4 prompts x 8 rollouts, 12 tokens, learning rate
1e-3, 8 steps, 75-100 s a run): mean reward 0.05 at step 0 and 0.68 at step 7 (seed 0), 0.15 ->
0.74 (seed 1), 0.18 -> 0.75 (seed 2). Every sampled token was kept as the sampler's own id: 1,442
of 1,442 (seed 0), 1,407/1,407 and 1,651/1,651. (Fewer train: members of a group at its mean
reward, and groups whose rewards are all equal, have no advantage; 1,308 trained in seed 0.)
Don't put a `seed` in `sampling_args`: a group shares them, and its rollouts would all be equal.
Needs verifiers' classic Environment API (verifiers < 0.4; 0.3.1 tested) and `datasets`.
Run:  python examples/verifiers_env.py [--steps 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import re

import art
from art.verifiers import trajectory_group_with_verifiers_environment

WORD_SCORES = {"maybe": 1.0, "no": 0.75, "yes": 0.5}


def make_rows() -> list[dict]:
    rows = []
    for words in itertools.permutations(["yes", "no", "maybe"]):
        for template in ("Respond with {a}, {b} or {c}.", "Just answer {a}, {b}, or {c}.",
                         "Reply with one word: '{a}', '{b}' or '{c}'.",
                         "Pick one of {a}/{b}/{c} and say only that word."):
            rows.append({"question": template.format(a=words[0], b=words[1], c=words[2]), "answer": "maybe"})
    return rows


def reply_of(completion) -> str:
    return completion[-1].content or "" if completion else ""


def word_score(completion) -> float:
    """The first yes/no/maybe in the reply."""
    first = next((w for w in re.findall(r"[a-z]+", reply_of(completion).lower()) if w in WORD_SCORES), None)
    return WORD_SCORES.get(first, 0.0)


def short_word_score(completion) -> float:
    """The same, only for replies of at most three words."""
    return word_score(completion) if len(reply_of(completion).split()) <= 3 else 0.0


def num_words(completion) -> float:
    return float(len(reply_of(completion).split()))


def sampled_tokens(state) -> float:
    """Completion tokens the server reported sampling for this rollout (its usage)."""
    return float(sum(step["response"].usage.completion_tokens for step in state["trajectory"]
                     if step["response"].usage is not None))


def make_env():
    import verifiers as vf
    from datasets import Dataset

    rubric = vf.Rubric(funcs=[word_score, short_word_score], weights=[0.5, 0.5])
    rubric.add_metric(num_words)
    rubric.add_metric(sampled_tokens)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(make_rows()), rubric=rubric)


async def main(steps: int, seed: int, group_size: int, prompts_per_step: int, learning_rate: float,
               max_tokens: int, path: str) -> list[float]:
    """Train; returns the mean reward of every step's rollouts (sampled before its update)."""
    env = make_env()
    rows = env.get_dataset().to_list()
    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name=f"verifiers-seed{seed}", project="verifiers-env", base_model=art.DEFAULT_MODEL)
    await model.register(backend)
    rewards = []
    for step in range(await model.get_step(), steps):
        rng = random.Random(seed * 10_000 + step)
        # No `seed` in sampling_args: a group shares them, and one seed would make its rollouts identical.
        groups = await art.gather_trajectory_groups(
            (trajectory_group_with_verifiers_environment(env, model, [row] * group_size,
                                                         sampling_args={"max_tokens": max_tokens})
             for row in rng.sample(rows, prompts_per_step)),
            pbar_desc=f"step {step} rollouts")
        trajectories = [t for g in groups for t in g.trajectories]
        reward = sum(t.reward for t in trajectories) / len(trajectories)
        exact = sum(len(item.token_ids or []) for t in trajectories for item in t.messages_and_choices
                    if not isinstance(item, dict))
        sampled = sum(t.metrics.get("sampled_tokens", 0) for t in trajectories)
        await model.train(groups, config=art.TrainConfig(learning_rate=learning_rate))
        rewards.append(reward)
        print(f"step {step}: mean reward {reward:.3f}; sampled tokens kept as the sampler's ids: "
              f"{exact}/{sampled:.0f} ({exact / max(sampled, 1):.0%})", flush=True)
    await backend.close()
    return rewards


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.seed, args.group_size, args.prompts_per_step, args.learning_rate,
                     args.max_tokens, args.path))
