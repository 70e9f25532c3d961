"""Train on RULER rewards: no reward function, a judge model ranks each group against a rubric.

The yes/no/maybe task of examples/yes_no_maybe.py, but the reward the policy trains on is the
judge's score; the task's own score is kept as `independent_reward` (logged per step as
`train/independent_reward`), so you can watch whether the judge's preferences teach the task.

By default the judge is the base model itself, served by the same backend with no adapter
(`judge=model, judge_model=model.base_model`), with constrained JSON output so every answer
parses. On the CPU that is SmolLM2-135M, a weak judge: see benchmarks/ruler_agreement.py for
how well it ranks. Any OpenAI-compatible server is a stronger judge:

    python examples/ruler_yes_no_maybe.py [--steps 8]
    python examples/ruler_yes_no_maybe.py --judge-base-url http://host:8000/v1 --judge-model Qwen/Qwen3-8B
    OPENAI_API_KEY=... python examples/ruler_yes_no_maybe.py --judge-model openai/o4-mini --judge-base-url https://api.openai.com/v1

Judge answers are cached in the run's folder (`.art/<project>/models/<name>/ruler_cache`);
delete that folder to clear it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from yes_no_maybe import make_prompts, plot_rewards, score  # noqa: E402

import art  # noqa: E402
from art.rewards import ruler_score_group  # noqa: E402

RUBRIC = """
- The task is to reply with one word. The best reply is "maybe"; "no" is second best; "yes" is third; any other reply is worst.
- A reply longer than three words is worth half as much as the same answer given briefly.
"""


async def rollout(model: art.Model, prompt: str, seed: int) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=12, seed=seed)
    choice = completion.choices[0]
    # The task's own score; RULER moves it to metrics["independent_reward"].
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=score(choice.message.content or ""))


async def main(args: argparse.Namespace) -> None:
    backend = art.LocalBackend(path=args.path)
    model = art.TrainableModel(name=f"ruler-seed{args.seed}", project="yes-no-maybe", base_model=art.DEFAULT_MODEL)
    await model.register(backend)
    if args.judge_base_url:
        judge, judge_model = args.judge_base_url, args.judge_model
    else:  # the base model, served next to the policy without its adapter
        judge, judge_model = model, model.base_model

    async def judged(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        return await ruler_score_group(group, judge_model, rubric=RUBRIC, judge=judge,
                                       judge_api_key=args.judge_api_key, cache=model, swallow_exceptions=True,
                                       extra_params={"temperature": 0.0, "max_tokens": 1024})

    prompts = make_prompts()
    run_dir = Path(args.path) / model.project / "models" / model.name
    curve = run_dir / "task_reward.png"
    print(f"task reward curve (redrawn every step): {curve}")
    for step in range(await model.get_step(), args.steps):
        rng = random.Random(args.seed * 10_000 + step)
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, p, seed=rng.randrange(2**31)) for _ in range(args.group_size))
             for p in rng.sample(prompts, args.prompts_per_step)),
            after_each=judged, pbar_desc=f"step {step} rollouts + judge")
        trajectories = [t for g in groups for t in g.trajectories]
        if not trajectories:
            print(f"step {step}: the judge gave no usable answer for any group; skipped")
            continue
        true = sum(t.metrics["independent_reward"] for t in trajectories) / len(trajectories)
        judge_mean = sum(t.reward for t in trajectories) / len(trajectories)
        await model.train(groups, config=art.TrainConfig(learning_rate=args.learning_rate))
        print(f"step {step}: task reward {true:.3f}, judge score {judge_mean:.3f}", flush=True)
        rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
        plot_rewards(sorted((r["step"], r["train/independent_reward"]) for r in rows if "train/independent_reward" in r),
                     curve, title="yes/no/maybe on RULER rewards: the task's own score per step")
    await backend.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--path", default=".art")
    parser.add_argument("--judge-base-url", default=None, help="An OpenAI-compatible /v1 URL; default: the base model")
    parser.add_argument("--judge-model", default="openai/o4-mini")
    parser.add_argument("--judge-api-key", default=os.environ.get("JUDGE_API_KEY"))
    asyncio.run(main(parser.parse_args()))
