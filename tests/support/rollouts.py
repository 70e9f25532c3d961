"""A rollout whose reward needs no judgement: the parity of the first sampled token. Tests that
need real training steps with rewards that differ (the probe's, the vLLM engine's) use it."""

from __future__ import annotations

import art


async def rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
    messages = [{"role": "user", "content": "Pick a token."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.name, messages=messages, max_tokens=4, seed=seed)
    choice = completion.choices[0]
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=float(choice.token_ids[0] % 2))


async def groups(model, step: int, size: int = 4) -> list[art.TrajectoryGroup]:
    """Two groups of `size` rollouts, seeded by `step` (so each step samples anew)."""
    return await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, 10 * step + i) for i in range(size)) for _ in range(2)], pbar_desc=None)
