"""An OpenAI Agents SDK agent with a function tool, trained unchanged: the default model, on CPU.

The agent below is written as the Agents SDK's docs write one (`Agent`, `@function_tool`,
`Runner.run`); only its model is ours: `OpenAIResponsesModel(model=<our model name>,
openai_client=model.openai_client())`, which calls our server's `/v1/responses`. Each rollout
runs the agent inside `art.trajectory(...)`, which records every Responses call as the chat turn
it stands for, with the token ids the sampler produced, so `model.train` trains on exactly
those ids. The SDK's tracing exports to OpenAI's servers; `set_tracing_disabled(True)` turns it
off (the SDK's documented switch; `OPENAI_AGENTS_DISABLE_TRACING=1` does the same).

Each episode asks for a product of two 2-digit numbers. The first model call is
`tool_choice="required"` (`ModelSettings`), so the agent calls `multiply`, whose integer
arguments the server enforces by grammar; the SDK resets the choice to "auto" after a tool
call (its default), and the agent answers in text. Reward: 0.8 when the final answer's first
number is the product, plus 0.2 when a `multiply` call computed it.

Every step prints the success rate, mean reward, valid tool calls, and two token counts: the
share of the tokens the SDK reports the model produced (`usage.output_tokens`, via `RunHooks`)
that were captured as sampled ids, and the share that trains as exact ids (nothing re-tokenised).

Measured on the 2-core CPU (shared with other jobs; seed 0, defaults: 4 problems x 4 rollouts
per step, ART's CISPO objective), mean reward by step 0-7: 0.100 0.225 0.175 0.537 0.350 0.200
0.350 0.550 (success 0.00 -> 0.44, valid tool calls 0.50 -> 1.00 from step 4), 5.2 minutes in
all. Of the 8,830 tokens the SDK reported the model produced over those 128 episodes, every one
was captured as the sampler's id and enters training as that id (both shares 1.000 at every step: each
turn's prompt extends the last turn's ids, so nothing is re-tokenised). A shorter run (4 steps,
2 x 4 rollouts) went 0.075 0.175 0.250 0.175; runs of one seed differ (CPU sampling of
concurrent requests is not bit-reproducible).
Run:  python examples/openai_agents_tool.py [--steps 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
from collections import Counter
from dataclasses import dataclass

from agents import (Agent, ModelResponse, ModelSettings, OpenAIResponsesModel, RunContextWrapper, RunHooks, Runner,
                    function_tool, set_tracing_disabled)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from pydantic import Field
from typing_extensions import Annotated

import art
from art.training.sequences import sequences_of_trajectory

set_tracing_disabled(True)  # no trace export to OpenAI: this trains offline
SUCCESS_REWARD, TOOL_REWARD = 0.8, 0.2
Number = Annotated[int, Field(ge=0, le=9999)]


@dataclass
class Episode:
    """One rollout's problem and what happened (the SDK's run context)."""

    a: int
    b: int
    computed: bool = False
    output_tokens: int = 0  # what the SDK reports the model produced, every call


@function_tool
def multiply(ctx: RunContextWrapper[Episode], a: Number, b: Number) -> str:
    """Multiply two whole numbers."""
    ctx.context.computed = ctx.context.computed or a * b == ctx.context.a * ctx.context.b
    return str(a * b)


class CountTokens(RunHooks[Episode]):
    async def on_llm_end(self, context: RunContextWrapper[Episode], agent: Agent, response: ModelResponse) -> None:
        context.context.output_tokens += response.usage.output_tokens


def calculator(model: art.Model) -> Agent[Episode]:
    return Agent(
        name="calculator",
        instructions="Use the multiply tool, then reply with only the result.",
        tools=[multiply],
        model=OpenAIResponsesModel(model=model.get_inference_name(), openai_client=model.openai_client()),
        model_settings=ModelSettings(tool_choice="required", max_tokens=48),
    )


def first_number(text: str | None) -> str | None:
    match = re.search(r"-?\d+", text or "")
    return match.group() if match else None


async def rollout(agent: Agent[Episode], a: int, b: int) -> art.Trajectory:
    episode = Episode(a, b)

    async def run() -> None:  # plain Agents SDK code
        try:
            result = await Runner.run(agent, f"What is {a} * {b}?", context=episode, hooks=CountTokens(),
                                      max_turns=3)
            answer = result.final_output
        except MaxTurnsExceeded:  # kept calling the tool: no answer, its turns still train
            answer = None
        except ModelBehaviorError:  # the answer ran past max_tokens ("incomplete"; the SDK 0.24 raises, as
            answer = None          # it does against OpenAI): no answer, its turns still train
        success = episode.computed and first_number(answer) == str(a * b)
        trajectory = art.current_trajectory(require=True)
        trajectory.reward = SUCCESS_REWARD * success + TOOL_REWARD * episode.computed
        trajectory.metrics.update(success=float(success), valid_tool_call=float(episode.computed))

    trajectory = await art.trajectory(run())
    choices = [item for history in [trajectory, *trajectory.additional_histories]
               for item in history.messages_and_choices if not isinstance(item, dict)]
    trained = sum(s.num_trained for s in sequences_of_trajectory(trajectory, Counter()))
    trajectory.metrics.update(sdk_output_tokens=float(episode.output_tokens),
                              captured_tokens=float(sum(len(c.token_ids or []) for c in choices)),
                              exact_tokens=float(trained))
    return trajectory


async def main(steps: int = 8, seed: int = 0, group_size: int = 4, problems_per_step: int = 4,
               learning_rate: float = 1e-3, path: str = ".art") -> list[dict]:
    """Train; returns one row per step, measured on that step's episodes before its update."""
    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name=f"agents-sdk-seed{seed}", project="openai-agents",
                               base_model=art.DEFAULT_MODEL)
    await model.register(backend)
    agent = calculator(model)
    rows, start = [], time.monotonic()
    for step in range(await model.get_step(), steps):
        rng = random.Random(seed * 10_000 + step)
        problems = [(rng.randint(11, 99), rng.randint(11, 99)) for _ in range(problems_per_step)]
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(agent, a, b) for _ in range(group_size)) for a, b in problems),
            pbar_desc=None)
        trajectories = [t for g in groups for t in g.trajectories]
        total = {key: sum(t.metrics[key] for t in trajectories)
                 for key in ("success", "valid_tool_call", "sdk_output_tokens", "captured_tokens", "exact_tokens")}
        row = {"step": step, "reward": sum(t.reward for t in trajectories) / len(trajectories),
               "success": total["success"] / len(trajectories),
               "valid_tool_call": total["valid_tool_call"] / len(trajectories),
               "captured_share": total["captured_tokens"] / max(total["sdk_output_tokens"], 1),
               "exact_share": total["exact_tokens"] / max(total["sdk_output_tokens"], 1)}
        await model.train(groups, config=art.TrainConfig(learning_rate=learning_rate))
        row["seconds"] = time.monotonic() - start
        rows.append(row)
        print(f"step {step}: reward {row['reward']:.3f}  success {row['success']:.2f}  "
              f"valid tool calls {row['valid_tool_call']:.2f}  tokens captured {row['captured_share']:.3f}, "
              f"trained as exact ids {row['exact_share']:.3f}  ({row['seconds']:.0f} s)", flush=True)
    await backend.close()
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--problems-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--path", default=".art")
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.seed, args.group_size, args.problems_per_step, args.learning_rate, args.path))
