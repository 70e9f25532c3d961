"""Train an agent that was written without ART: its OpenAI calls are captured into trajectories.

`answer_agent` below stands for existing agent code: it knows only the `openai` client. It drafts
a one-word answer, has a separate "checker" conversation judge the draft, then asks the drafter
again, streamed. `art.capture_auto_trajectory` records the three calls: the drafter's two turns
as the trajectory, the checker's call as an additional history; the rollout sets the reward.
Run:  python examples/auto_capture.py [--steps 3] [--base-model PATH]
On the default model and 2 CPU cores a step takes about a minute (16 rollouts, 48 calls, a train step).
"""

from __future__ import annotations

import argparse
import asyncio
import re

from openai import AsyncOpenAI

import art

QUESTIONS = ["Is the sky blue?", "Can fish fly?", "Will it rain tomorrow?", "Is zero even?"]


async def answer_agent(client: AsyncOpenAI, model: str, question: str) -> str:
    """Existing agent code: plain `openai` calls, two conversations, one of them streamed."""
    drafter = [{"role": "system", "content": "Answer with one word: yes, no or maybe."},
               {"role": "user", "content": question}]
    draft = await client.chat.completions.create(model=model, messages=drafter, max_tokens=8)
    draft_text = draft.choices[0].message.content or ""
    check = [{"role": "user", "content": f"Question: {question}\nAnswer: {draft_text}\nIs the answer one word?"}]
    await client.chat.completions.create(model=model, messages=check, max_tokens=8)
    drafter += [{"role": "assistant", "content": draft_text}, {"role": "user", "content": "Say it once more."}]
    stream = await client.chat.completions.create(model=model, messages=drafter, max_tokens=8, stream=True)
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])


def score(reply: str) -> float:
    words = re.findall(r"[a-z]+", reply.lower())
    reward = 1.0 if words[:1] and words[0] in ("yes", "no", "maybe") else 0.0
    return reward / 2 if len(words) > 3 else reward


async def rollout(model: art.Model, question: str) -> art.Trajectory:
    async def run() -> None:
        reply = await answer_agent(model.openai_client(), model.get_inference_name(), question)
        art.auto_trajectory(required=True).reward = score(reply)

    return await art.capture_auto_trajectory(run())


async def main(steps: int, base_model: str, path: str, group_size: int = 4) -> list[float]:
    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name="auto-capture", project="examples", base_model=base_model)
    await model.register(backend)
    rewards = []
    for step in range(await model.get_step(), steps):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, q) for _ in range(group_size)) for q in QUESTIONS),
            pbar_desc=f"step {step}")
        rewards.append(sum(t.reward for g in groups for t in g) / sum(len(g) for g in groups))
        print(f"step {step}: mean reward {rewards[-1]:.3f}", flush=True)
        await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
    await backend.close()
    return rewards


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--base-model", default=art.DEFAULT_MODEL)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.base_model, args.path))
