"""The run the dashboard tests read: a tiny model trained two steps by real rollouts, and what
the tests send (tests/dashboard/conftest.py builds it once for the package)."""

from __future__ import annotations

import httpx

import art

LONG_CONTEXT_LINES = 60
"""Group 1's prompt has this many lines of rules: its trained tokens lie below the token view's fold."""


async def rollout(model: art.TrainableModel, seed: int, rules: int = 0) -> art.Trajectory:
    prompt = "Pick a token." + "".join(f"\nrule {i}" for i in range(rules))
    messages = [{"role": "user", "content": prompt}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4, seed=seed)
    # Alternating rewards: every group has a spread, so every trained token has an advantage.
    return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=float(seed % 2),
                          metrics={"tokens": len(completion.choices[0].token_ids)},
                          metadata={"scenario": f"game {seed}", "secret": seed % 7})


async def train_step(model: art.TrainableModel, step: int) -> None:
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, seed=100 * step + 10 * g + i, rules=LONG_CONTEXT_LINES * g)
                             for i in range(4)) for g in range(2)],
        pbar_desc=None)
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))


def get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, timeout=30, **kwargs)


KEY = "dash-key"
AS_BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
"""What a browser's Accept says when it opens a page."""
