"""MCP·RL (`art.mcp`) against a real MCP server and a real model server.

The MCP server is our own (tests/support/mcp_server.py), started over stdio as a subprocess;
the policy, the scenario generator and the RULER judge are a tiny random model served by a
LocalBackend on loopback, whose constrained decoding makes even random weights answer in the
asked-for JSON and call the forced tool. Only the generator's failure modes (bad items, a
refused response_format) come from a scripted OpenAI-compatible endpoint: a real model cannot
be made to produce them on demand.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import pytest_asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import art
from art.training.advantages import group_advantages
from art.mcp import (COMPLETE_TASK, GeneratedScenario, GeneratedScenarioCollection, MCPTool, McpScenario,
                     ScenarioGenerationError, generate_scenarios, list_tools_and_resources, mcp_rollout,
                     ruler_score_mcp_group)
from art.server.thread import ServerThread

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ADD = {"type": "function", "function": {"name": "add"}}
FINISH = {"type": "function", "function": {"name": COMPLETE_TASK}}


class McpServerProcess:
    """tests/support/mcp_server.py over stdio, its session opened and closed in one task of its
    own (the SDK's task groups must be left in the task that entered them)."""

    def __init__(self) -> None:
        self.session = None
        self._ready, self._stop = asyncio.Event(), asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> McpServerProcess:
        self._task = asyncio.create_task(self._run())
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait([self._task, ready], return_when=asyncio.FIRST_COMPLETED, timeout=60)
        if not self._ready.is_set():
            ready.cancel()
            why = self._task.exception() if self._task.done() else "timeout"
            raise RuntimeError(f"the MCP server did not start: {why}")
        return self

    async def _run(self) -> None:
        from mcp import ClientSession
        from mcp.client.stdio import StdioServerParameters, stdio_client

        params = StdioServerParameters(command=sys.executable, args=["-m", "tests.support.mcp_server"], cwd=str(ROOT))
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            self.session = session
            self._ready.set()
            await self._stop.wait()

    async def stop(self) -> None:
        self._stop.set()
        await self._task


@pytest.fixture(scope="module")
def long_tiny_model(tiny_model_path, tmp_path_factory):
    """The tiny random model with 4096 positions: room for the tools in a prompt and a judged group."""
    out = tmp_path_factory.mktemp("tiny-4k-mcp") / "model"
    shutil.copytree(tiny_model_path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(long_tiny_model, tmp_path_factory):
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("mcp")))
    model = art.TrainableModel(name="mcp-agent", project="mcp", base_model=str(long_tiny_model))
    await model.register(backend)
    yield model, backend
    await backend.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server():
    pytest.importorskip("mcp", reason="the MCP SDK is the `integrations` extra")
    process = await McpServerProcess().start()
    yield process
    await process.stop()


@pytest.fixture
def model(served):
    return served[0]


@pytest.fixture
def session(server):
    return server.session


def choices(trajectory: art.Trajectory) -> list:
    return [item for item in trajectory.messages_and_choices if not isinstance(item, dict)]


async def test_lists_the_servers_tools_and_resources(session):
    tools, resources = await list_tools_and_resources(session)
    assert [t.name for t in tools] == ["add", "count_words", "calls_so_far"]
    add = tools[0]
    assert add.description == "Add two whole numbers." and add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert add.to_openai() == {"type": "function", "function": {"name": "add", "description": "Add two whole numbers.",
                                                                "parameters": add.parameters}}
    [guide] = resources
    assert (guide.uri, guide.name, guide.mime_type) == ("notes://guide", "guide", "text/plain")
    assert guide.to_dict()["mimeType"] == "text/plain"


async def test_our_tiny_model_writes_the_scenarios_asked_for(model, session):
    tools, resources = await list_tools_and_resources(session)
    # ART's signature: the generator is any OpenAI-compatible endpoint, here our own server.
    scenarios = await generate_scenarios(tools, resources, num_scenarios=3, show_preview=False,
                                         generator_model=model.get_inference_name(), generator_api_key="unused",
                                         generator_base_url=model.inference_base_url, max_task_chars=60,
                                         extra_params={"seed": 1})
    assert isinstance(scenarios, GeneratedScenarioCollection) and len(scenarios) == 3
    assert all(isinstance(s, GeneratedScenario) and 1 <= s.difficulty <= 5 and 0 < len(s.task) <= 60
               for s in scenarios)
    assert len({s.task for s in scenarios}) == 3
    # The collection round-trips through JSON, as ART's does.
    assert GeneratedScenarioCollection.from_json(scenarios.to_json()).to_dicts() == scenarios.to_dicts()
    # The registered model itself as the generator; tool dicts in ART's shape.
    again = await generate_scenarios([t.to_dict() for t in tools], num_scenarios=2, show_preview=False,
                                     generator=model, max_task_chars=40, extra_params={"seed": 2})
    assert len(again) == 2


def test_scenario_collections_validate_split_and_filter():
    collection = GeneratedScenarioCollection.from_json(answer(("a", 1), ("b", 3), ("c", 5)))
    train, val = collection.split(2)
    assert [s.task for s in train] == ["a", "b"] and [s.task for s in val] == ["c"]
    assert [s.task for s in collection.filter_by_difficulty(2, 4)] == ["b"]
    assert sorted(s.task for s in collection.shuffle(seed=1)) == ["a", "b", "c"] and collection[0].task == "a"
    assert collection.get_summary() == {"total_scenarios": 3, "difficulty_distribution": {1: 1, 3: 1, 5: 1},
                                        "avg_difficulty": 3.0, "avg_task_length": 1.0}
    for bad in ({"task": "x", "difficulty": 6}, {"task": " ", "difficulty": 1}, {"task": "x", "difficulty": True}):
        with pytest.raises(art.ArtValueError):
            GeneratedScenario.from_dict(bad)
    with pytest.raises(art.ArtValueError, match="train_size"):
        collection.split(4)


class ScriptedGenerator:
    """An OpenAI-compatible endpoint answering from a queue; `refuse_schemas` answers 400 to a
    json_schema response_format, as endpoints without structured output do."""

    def __init__(self, answers: list[str], refuse_schemas: bool = False) -> None:
        self.answers, self.requests = list(answers), []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            if refuse_schemas and (body.get("response_format") or {}).get("type") == "json_schema":
                return JSONResponse({"error": {"message": "response_format json_schema is not supported",
                                               "type": "invalid_request_error", "param": "response_format"}}, 400)
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": self.answers.pop(0)}}]}

        self.app = app


def answer(*items) -> str:
    return json.dumps({"scenarios": [{"task": t, "difficulty": d} for t, d in items]})


async def test_bad_items_are_dropped_and_the_rest_asked_for_again():
    scripted = ScriptedGenerator([
        answer(("Add 2 and 3.", 1), ("Count words.", 7), ("add 2 and 3. ", 2), ("", 3)),
        "Sure! ```json\n" + answer(("Count the words of a poem.", "2")) + "\n```",
    ], refuse_schemas=True)
    tools = [MCPTool("add", "Add two numbers.", {"type": "object"})]
    with ServerThread(scripted.app) as http:
        scenarios = await generate_scenarios(tools, num_scenarios=2, show_preview=False, generator_model="m",
                                             generator_base_url=http.base_url + "/v1", generator_api_key="k")
    assert scenarios.to_dicts() == [{"task": "Add 2 and 3.", "difficulty": 1},
                                    {"task": "Count the words of a poem.", "difficulty": 2}]
    formats = [(r.get("response_format") or {}).get("type") for r in scripted.requests]
    assert formats == ["json_schema", "json_object", "json_object"]  # refused once, then not asked again
    second = scripted.requests[2]["messages"][0]["content"]
    assert "Write 1 different" in second and "- Add 2 and 3." in second  # only what is missing, not repeated

    scripted = ScriptedGenerator(["no JSON here", answer(("x", 9))])
    with ServerThread(scripted.app) as http:
        with pytest.raises(ScenarioGenerationError, match=r"0 usable scenario\(s\) of 1 in 2 call") as failed:
            await generate_scenarios(tools, num_scenarios=1, show_preview=False, generator_model="m",
                                     generator_base_url=http.base_url + "/v1", max_attempts=2)
    assert "not JSON" in str(failed.value) and "difficulty must be an integer" in str(failed.value)
    schema = scripted.requests[0]["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]
    assert (schema["minItems"], schema["maxItems"], schema["items"]["properties"]["task"]["maxLength"]) == (1, 1, 600)
    with pytest.raises(art.ArtValueError, match="at least one tool"):
        await generate_scenarios([], num_scenarios=1, generator_base_url="http://127.0.0.1:9/v1")


async def test_the_rollout_calls_the_servers_real_tools(model, session):
    tools, _ = await list_tools_and_resources(session)
    trajectory = await mcp_rollout(model, session, McpScenario("Add two numbers, then finish.", max_turns=3),
                                   tools=tools, first_tool_choice=ADD, tool_choice=FINISH, max_tokens=400,
                                   completion_params={"seed": 5})
    system, user, call_turn, tool, finish_turn = trajectory.messages_and_choices
    assert system["role"] == "system" and user["content"] == "Please complete this task: Add two numbers, then finish."
    [call] = call_turn.message.tool_calls
    args = json.loads(call.function.arguments)
    # Computed by the server process, not by this one.
    assert tool["role"] == "tool" and tool["tool_call_id"] == call.id
    sum_text, pid = re.fullmatch(r"(.*) \(pid (\d+)\)", tool["content"]).groups()
    assert sum_text == f"{args['a']} + {args['b']} = {args['a'] + args['b']}" and int(pid) != os.getpid()
    assert finish_turn.message.tool_calls[0].function.name == COMPLETE_TASK
    assert trajectory.metrics == {"task_completed": 1.0, "final_answer": 0.0, "cut_off": 0.0, "ran_out_of_turns": 0.0,
                                  "turns": 2.0, "tool_calls": 2.0, "tool_errors": 0.0}
    assert trajectory.metadata["task"] == "Add two numbers, then finish."
    assert trajectory.tools[-1]["function"]["name"] == COMPLETE_TASK and len(trajectory.tools) == 4
    # The trajectory holds the sampler's own ids: each Choice's token ids are all it produced.
    exchanges = trajectory.exchanges.chat_completions
    assert [len(c.token_ids) for c in choices(trajectory)] == [e.response.usage.completion_tokens for e in exchanges]
    assert trajectory.additional_histories == [] and trajectory.logs == []
    assert (await session.call_tool("calls_so_far", {})).content[0].text.startswith("add")

    # A tool the server does not have: its error is the agent's to read, not the rollout's failure.
    ghost = MCPTool("ghost", "Not on the server.", {"type": "object", "properties": {}, "additionalProperties": False})
    failed = await mcp_rollout(model, session, "Try the ghost.", tools=[*tools, ghost], max_turns=1,
                               first_tool_choice={"type": "function", "function": {"name": "ghost"}}, max_tokens=30)
    assert failed.messages_and_choices[-1].message.tool_calls[0].function.name == "ghost"
    assert failed.metrics["tool_errors"] == 1.0 and failed.metrics["ran_out_of_turns"] == 1.0


async def test_ruler_scores_groups_that_train_two_steps(model, session, served):
    backend = served[1]
    tools, _ = await list_tools_and_resources(session)
    scenarios = [McpScenario("Add 19 and 23.", max_turns=2), McpScenario("Count the words in 'a b c'.", max_turns=2)]
    for step in range(2):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(mcp_rollout(model, session, s, tools=tools, first_tool_choice=ADD,
                                             max_tokens=96, completion_params={"seed": 100 * step + 10 * g + i})
                                 for i in range(3))
             for g, s in enumerate(scenarios)),
            after_each=lambda g: ruler_score_mcp_group(g, model, swallow_exceptions=False,
                                                       extra_params={"temperature": 1.0}),
            pbar_desc=None)
        assert len(groups) == 2
        trajectories = [t for g in groups for t in g.trajectories]
        assert all(0.0 <= t.reward <= 1.0 and t.metrics["ruler_score"] == t.reward for t in trajectories)
        assert all(t.metrics["independent_reward"] == 0.0 for t in trajectories)
        # The forced call went to the server unless the random model's integer ran past max_tokens.
        assert all(t.metrics["tool_calls"] >= 1 or t.metrics["cut_off"] for t in trajectories)
        assert sum(t.metrics["tool_calls"] for t in trajectories) >= len(trajectories) // 2
        assert all(g.metrics["ruler/judge_calls"] + g.metrics["ruler/cache_hits"] >= 1 for g in groups)
        # Every token the sampler produced trains, as the ids it sampled, for each member with an
        # advantage (a group the judge scored alike, or a member at its group's mean, has none).
        with_advantage = [t for g in groups for t, a in zip(g, group_advantages([t.reward for t in g])) if a != 0]
        sampled = sum(len(c.token_ids) for t in with_advantage for c in choices(t))
        produced = sum(e.response.usage.completion_tokens for t in with_advantage for e in t.exchanges.chat_completions)
        result = await backend.train(model, groups, learning_rate=1e-3)
        assert result.step == step + 1
        assert result.metrics.get("trained_tokens", 0.0) == sampled == produced
        uniform = sum(len({t.reward for t in g}) == 1 for g in groups)
        skipped = {k: v for k, v in result.metrics.items() if k.startswith("skipped/")}
        assert skipped == ({"skipped/group_rewards_all_equal": float(uniform)} if uniform else {}), result.metrics
    assert await model.get_step() == 2
