"""MCP·RL end to end: teach the default model to use an MCP server's tools, on RULER rewards.

The steps of ART's MCP·RL, all local: this file is also the MCP server (a small country
almanac: three tools and a resource), started over stdio as a subprocess; its tools are listed
(`art.mcp.list_tools_and_resources`); the policy model writes the training tasks itself
(`art.mcp.generate_scenarios` with `generator=model`; `--fixed-scenarios` uses the list below
instead); each task gets a group of episodes (`art.mcp.mcp_rollout`: the server's tools plus
`complete_task`, the first turn forced to call a tool, because a 135M model never calls one
unprompted); RULER scores each group (`art.mcp.ruler_score_mcp_group`; the judge is the base
model served beside the policy unless `--judge-base-url`/`--judge-model` name a stronger one);
the model trains on the scores. Every turn is captured with the server's token ids, so the
update trains on exactly what was sampled: each step prints the share of sampled tokens that
trained.

Measured on the 2-core CPU, shared with other jobs (default model, seed 0): with the defaults the
135M judge scored all 8 episodes of step 0 exactly 0.500 (as benchmarks/ruler_agreement.py found:
it gives every candidate one score), so nothing trains; the model-written tasks were fragments
("Add Users to the Almanac"). With `--fixed-scenarios --judge-temperature 1.0 --steps 4` the
sampled judge's scores differ but carry no task signal: mean RULER reward by step 0-3 0.510 0.399
0.637 0.562; the share of each fixed task's known facts that the final answer states (kept as
`independent_reward`, not trained on) 0.00 0.25 0.00 0.00. Of 2,890 sampled tokens 1,471 trained: every token
of each group whose scores differed (701/701, 383/383, 387/387: all the sampler's own ids), none
of the groups scored alike. 50-160 s a step. MCP·RL needs a judge stronger than the policy:
pass `--judge-base-url`/`--judge-model`.
Run:  python examples/mcp_rl.py [--steps 6] [--fixed-scenarios] [--judge-temperature 1.0]
                                [--judge-base-url URL --judge-model NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import art
from art.mcp import (COMPLETE_TASK, GeneratedScenario, generate_scenarios, list_tools_and_resources, mcp_rollout,
                     ruler_score_mcp_group)

COUNTRIES = {
    "France": ("Paris", 68.2, "euro"), "Japan": ("Tokyo", 124.5, "yen"), "Brazil": ("Brasília", 203.1, "real"),
    "Kenya": ("Nairobi", 55.1, "shilling"), "Canada": ("Ottawa", 40.1, "dollar"),
    "India": ("New Delhi", 1428.6, "rupee"),
    "Egypt": ("Cairo", 112.7, "pound"), "Norway": ("Oslo", 5.5, "krone"),
}
FIXED_SCENARIOS = [  # (task, facts a correct final answer mentions)
    (GeneratedScenario("What is the capital of Japan? Give a one-line answer.", 1), ["Tokyo"]),
    (GeneratedScenario("Which has more people, Kenya or Canada? Report both populations.", 2),
     ["Kenya", "55.1", "40.1"]),
    (GeneratedScenario("Find the currency of Egypt and the capital of Norway, then summarize.", 2), ["pound", "Oslo"]),
    (GeneratedScenario("Compare the populations of France and Brazil and say which is larger.", 2), ["Brazil"]),
    (GeneratedScenario("Which country in the almanac has the most people?", 3), ["India"]),
    (GeneratedScenario("What is the population of India in millions? Summarize the result.", 1), ["1428.6"]),
    (GeneratedScenario("Give the capital and currency of Kenya.", 2), ["Nairobi", "shilling"]),
    (GeneratedScenario("What is the capital of Brazil?", 1), ["Brasília"]),
]
FACTS = {scenario.task: facts for scenario, facts in FIXED_SCENARIOS}


def serve_mcp() -> None:
    """The MCP server (run by the training process as `python examples/mcp_rl.py --serve-mcp`)."""
    try:
        from mcp.server import MCPServer as Server
    except ImportError:  # the MCP SDK 1.x
        from mcp.server.fastmcp import FastMCP as Server

    server = Server("country-almanac")

    @server.tool()
    def country_facts(country: str) -> str:
        """The capital, population (millions) and currency of a country."""
        facts = COUNTRIES.get(country.strip().title())
        if facts is None:
            return f"Unknown country {country!r}; known: {', '.join(COUNTRIES)}."
        return f"{country.strip().title()}: capital {facts[0]}, population {facts[1]} million, currency {facts[2]}."

    @server.tool()
    def list_countries() -> str:
        """The countries the almanac knows."""
        return ", ".join(COUNTRIES)

    @server.tool()
    def compare_population(first: str, second: str) -> str:
        """Which of two countries has more people, and by how much."""
        a, b = COUNTRIES.get(first.strip().title()), COUNTRIES.get(second.strip().title())
        if a is None or b is None:
            return f"Unknown country; known: {', '.join(COUNTRIES)}."
        bigger, smaller = (first, second) if a[1] >= b[1] else (second, first)
        return f"{bigger.title()} has {abs(a[1] - b[1]):.1f} million more people than {smaller.title()}."

    @server.resource("almanac://about", name="about", description="What the almanac holds.", mime_type="text/plain")
    def about() -> str:
        return "Capitals, populations (millions, 2023) and currencies of eight countries."

    server.run()


def final_text(trajectory: art.Trajectory) -> str:
    """What the agent finally said: its `complete_task` summary, else its last reply's text."""
    last = trajectory.messages_and_choices[-1]
    if isinstance(last, dict):
        return ""
    for call in last.message.tool_calls or []:
        if call.function.name == COMPLETE_TASK:
            try:
                return str(json.loads(call.function.arguments).get("summary", ""))
            except (ValueError, AttributeError):
                return call.function.arguments
    return last.message.content or ""


async def rollout(model: art.TrainableModel, session, scenario: GeneratedScenario, **options) -> art.Trajectory:
    """An MCP·RL episode; its reward before judging is the share of the task's known facts the
    final answer states (0 for a generated task). RULER keeps it as `independent_reward`: it
    shows whether the judge's scores teach the task, and does not train."""
    trajectory = await mcp_rollout(model, session, scenario, **options)
    facts = FACTS.get(scenario.task, [])
    said = final_text(trajectory).lower()
    trajectory.reward = sum(fact.lower() in said for fact in facts) / len(facts) if facts else 0.0
    return trajectory


async def train(session, backend: art.LocalBackend, model: art.TrainableModel, *, steps: int, seed: int,
                fixed_scenarios: bool, groups_per_step: int, group_size: int, max_turns: int, max_tokens: int,
                learning_rate: float, judge: str | None, judge_model: str | None,
                judge_temperature: float) -> list[dict]:
    tools, resources = await list_tools_and_resources(session)
    print(f"MCP server: tools {[t.name for t in tools]}, resources {[r.uri for r in resources]}")
    needed = steps * groups_per_step
    if fixed_scenarios:
        scenarios = [scenario for scenario, _ in FIXED_SCENARIOS]
    else:  # the policy writes its own tasks; a constrained schema keeps even a 135M model's answer valid
        scenarios = list(await generate_scenarios(tools, resources, num_scenarios=min(needed, 16), generator=model,
                                                  max_task_chars=160, extra_params={"seed": seed}))
    rng = random.Random(seed)
    rows, start = [], time.monotonic()
    for step in range(await model.get_step(), steps):
        chosen = [scenarios[(step * groups_per_step + i) % len(scenarios)] for i in range(groups_per_step)]
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(
                rollout(model, session, s, tools=tools, max_turns=max_turns, first_tool_choice="required",
                        max_tokens=max_tokens, completion_params={"seed": rng.randrange(2**31)})
                for _ in range(group_size)) for s in chosen),
            after_each=lambda g: ruler_score_mcp_group(g, model, judge=judge, judge_model=judge_model,
                                                       extra_params={"temperature": judge_temperature}),
            pbar_desc=f"step {step} episodes + RULER")
        trajectories = [t for g in groups for t in g.trajectories]
        if not trajectories:
            print(f"step {step}: the judge gave no usable answer for any group; skipped")
            continue
        produced = sum(e.response.usage.completion_tokens for t in trajectories for e in t.exchanges.chat_completions
                       if e.response.usage)
        sampled_ids = sum(len(i.token_ids or []) for t in trajectories for i in t.messages_and_choices
                          if not isinstance(i, dict))
        result = await backend.train(model, groups, learning_rate=learning_rate)
        await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        mean = lambda key: sum(t.metrics[key] for t in trajectories) / len(trajectories)  # noqa: E731
        row = {"step": step, "reward": sum(t.reward for t in trajectories) / len(trajectories),
               "facts": mean("independent_reward"),
               "tool_calls": mean("tool_calls"), "completed": mean("task_completed"), "produced": produced,
               "sampled_ids": sampled_ids, "trained": result.metrics.get("trained_tokens", 0.0),
               "groups_trained": result.metrics.get("groups_trained", 0.0), "seconds": time.monotonic() - start}
        rows.append(row)
        print(f"step {step}: mean RULER reward {row['reward']:.3f}  facts stated {row['facts']:.2f}  "
              f"tool calls {row['tool_calls']:.2f}  "
              f"complete_task {row['completed']:.2f}  trained {row['trained']:.0f} of {produced} sampled tokens "
              f"({row['groups_trained']:.0f} of {len(groups)} groups had differing scores)  ({row['seconds']:.0f} s)",
              flush=True)
    return rows


async def main(steps: int = 6, seed: int = 0, path: str = ".art", fixed_scenarios: bool = False,
               groups_per_step: int = 2, group_size: int = 4, max_turns: int = 3, max_tokens: int = 96,
               learning_rate: float = 1e-3, judge: str | None = None, judge_model: str | None = None,
               judge_temperature: float = 0.0, base_model: str = art.DEFAULT_MODEL) -> list[dict]:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    backend = art.LocalBackend(path=path)
    model = art.TrainableModel(name=f"mcp-almanac-seed{seed}", project="mcp-rl", base_model=base_model)
    await model.register(backend)
    server = StdioServerParameters(command=sys.executable, args=[os.path.abspath(__file__), "--serve-mcp"])
    try:
        async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            return await train(session, backend, model, steps=steps, seed=seed, fixed_scenarios=fixed_scenarios,
                               groups_per_step=groups_per_step, group_size=group_size, max_turns=max_turns,
                               max_tokens=max_tokens, learning_rate=learning_rate, judge=judge,
                               judge_model=judge_model, judge_temperature=judge_temperature)
    finally:
        await backend.close()


if __name__ == "__main__":
    if "--serve-mcp" in sys.argv:
        serve_mcp()
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed-scenarios", action="store_true", help="train on FIXED_SCENARIOS, generate none")
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--path", default=".art")
    parser.add_argument("--judge-base-url", default=None, help="an OpenAI-compatible /v1 URL; default: the base model")
    parser.add_argument("--judge-model", default=None, help="e.g. openai/o4-mini (OPENAI_API_KEY) or a served name")
    parser.add_argument("--judge-temperature", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.seed, args.path, args.fixed_scenarios, args.groups_per_step, args.group_size,
                     args.max_turns, args.max_tokens, args.learning_rate, args.judge_base_url, args.judge_model,
                     args.judge_temperature))
