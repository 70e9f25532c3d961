"""`art.langgraph` against a real loopback server: a LangGraph ReAct agent with a tool trains as written.

The agent calls the registered tiny model through `init_chat_model` (a plain `ChatOpenAI`), whole
and streamed; `wrap_rollout` must turn every model call of the graph into a `Choice` carrying
exactly the ids the server sent (read here off the wire, apart from the capture), keep tool results
as context, the user's reward and trajectory class, leave a foreign judge's call out, and the
groups must train two steps. A random model never picks a tool by itself: the first turn is
`tool_choice="required"`, which our server enforces with a grammar.
"""

from __future__ import annotations

import json
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

import httpx
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel

import art
from art.errors import ArtValueError
from art.trajectories import is_choice, sampled_steps
from tests.client.test_capture import assert_trains_whole

pytest.importorskip("langgraph")
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402

from art.langgraph import init_chat_model, wrap_rollout  # noqa: E402

pytestmark = pytest.mark.integration


def create_agent(model, tools):
    """ART's docs' prebuilt ReAct agent, which langgraph 1.x deprecates in favour of
    `langchain.agents.create_agent` (the `langchain` package; see the last test)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_react_agent(model, tools)


@tool
def weather(city: Literal["Paris", "Oslo"]) -> str:
    """Today's weather in a city."""
    return f"Sunny in {city}."


def forcing_first_turn(llm: ChatOpenAI):
    """The agent's model: a tool call forced on the first turn (`strict`: no other keys, so the
    grammar ends the call), the model's choice afterwards."""
    def pick(state, runtime):
        called = any(isinstance(m, ToolMessage) for m in state["messages"])
        return llm.bind_tools([weather], tool_choice="auto" if called else "required", strict=True)
    return pick


QUESTION = [SystemMessage("Use the tool."), HumanMessage("Weather in Paris?")]


class Verdict(BaseModel):
    sunny: Literal["yes", "no"]


class WeatherTrajectory(art.Trajectory):
    city: str | None = None


class WireTap(httpx.AsyncBaseTransport):
    """An HTTP transport that keeps each chat completion's body as it arrived (streamed or not)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[bytearray] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        body = bytearray()
        self.bodies.append(body)
        inner = response.stream

        class Copy(httpx.AsyncByteStream):
            async def __aiter__(self):
                async for part in inner:
                    body.extend(part)
                    yield part

            async def aclose(self):
                await inner.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=Copy(),
                              extensions=response.extensions)

    def sent(self) -> list[dict]:
        """Each body's choice-0 token ids and logprobs, whole or summed over a stream's chunks."""
        out = []
        for body in self.bodies:
            text = body.decode()
            if not text.startswith("data:"):
                choice = json.loads(text)["choices"][0]
                out.append({"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["content"]})
                continue
            ids, logprobs = [], []
            for line in text.splitlines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices") or []:
                        ids += choice.get("token_ids") or []
                        logprobs += (choice.get("logprobs") or {}).get("content") or []
            out.append({"token_ids": ids, "logprobs": logprobs})
        return out


class Judge(BaseHTTPRequestHandler):
    """Another provider's model, judging inside the rollout: its calls are not the policy's."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        body = json.dumps({"id": "j", "object": "chat.completion", "created": 1, "model": "judge-model", "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Looks right."},
             "logprobs": {"content": [{"token": "Looks", "logprob": -0.1, "bytes": None, "top_logprobs": []}]}}]})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(tiny_model_path, tmp_path_factory):
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("langgraph")))
    model = art.TrainableModel(name="tiny", project="langgraph", base_model=str(tiny_model_path))
    await model.register(backend)
    yield model, backend
    await backend.close()


@pytest.fixture(scope="module")
def judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x",
                             max_retries=0)
    server.shutdown()
    thread.join()


@pytest.mark.parametrize("streamed", [False, True], ids=["ainvoke", "astream"])
async def test_every_graph_call_trains_with_the_servers_ids(served, judge, streamed):
    model = served[0]
    wire = WireTap()
    seen: dict = {}

    async def rollout(question: list) -> WeatherTrajectory:  # ART's docs' shape
        llm = init_chat_model(model.name, max_tokens=40, http_async_client=httpx.AsyncClient(transport=wire))
        agent = create_agent(forcing_first_turn(llm), [weather])
        request, config = {"messages": question}, {"recursion_limit": 8}
        if streamed:  # LangGraph streams the chat model's tokens
            seen["text"] = "".join([part.content async for part, _ in agent.astream(request, config,
                                    stream_mode="messages") if isinstance(part, AIMessage)])
        else:
            seen["messages"] = (await agent.ainvoke(request, config))["messages"]
        seen["verdict"] = await llm.with_structured_output(Verdict).ainvoke("Was it sunny? Answer in JSON.")
        await judge.chat.completions.create(model="judge-model", messages=[{"role": "user", "content": "Grade."}])
        return WeatherTrajectory(messages_and_choices=[], reward=0.75, metrics={"graded": 1}, city="Paris")

    trajectory = await wrap_rollout(model, rollout)(QUESTION)

    assert isinstance(trajectory, WeatherTrajectory) and trajectory.city == "Paris"
    assert trajectory.reward == 0.75 and trajectory.metrics == {"graded": 1}
    items = trajectory.messages_and_choices
    choices = [i for i in items if is_choice(i)]
    *graph_bodies, verdict_body = wire.sent()
    # Every model call of the graph (and nothing else) is a Choice, in order, with the ids and
    # logprobs the server put on the wire.
    assert len(choices) == len(graph_bodies) >= 2
    assert all(body.startswith(b"data:") == streamed for body in wire.bodies[:-1])  # SSE when streamed
    for choice, body in zip(choices, graph_bodies):
        assert choice.token_ids == body["token_ids"] and len(choice.token_ids) >= 1
        assert [e.model_dump() for e in choice.logprobs.content] == body["logprobs"]
    # The conversation: prompt and tool result are context dicts around the model's turns.
    call = choices[0].message.tool_calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert items[:3] == [{"role": "system", "content": "Use the tool."},
                         {"role": "user", "content": "Weather in Paris?"}, choices[0]]
    city = json.loads(call.function.arguments)["city"]
    assert items[3] == {"role": "tool", "tool_call_id": call.id, "content": f"Sunny in {city}."}
    assert items[4] is choices[1] and [t["function"]["name"] for t in trajectory.tools] == ["weather"]
    if streamed:  # what LangGraph streamed is what the choices say
        assert seen["text"] == "".join(c.message.content or "" for c in choices)
    else:  # LangChain's own messages say the same
        said = [m for m in seen["messages"] if isinstance(m, AIMessage)]
        assert [m.tool_calls[0]["id"] if m.tool_calls else m.content for m in said] == \
               [c.message.tool_calls[0].id if c.message.tool_calls else c.message.content for c in choices]
    # The structured-output call is another conversation, trained too; the judge is not trained.
    [other] = trajectory.additional_histories
    [user, answer] = other.messages_and_choices
    assert user == {"role": "user", "content": "Was it sunny? Answer in JSON."} and other.tools is None
    assert answer.token_ids == verdict_body["token_ids"]
    assert Verdict.model_validate_json(answer.message.content) == seen["verdict"]
    assert len(trajectory.logs) == 1 and "judge-model" in trajectory.logs[0]
    assert [e.model for e in trajectory.exchanges.chat_completions] == [model.name] * (len(choices) + 1)
    assert_trains_whole(trajectory)


async def test_init_chat_model_needs_to_know_its_model(served):
    model = served[0]
    with pytest.raises(ArtValueError, match="wrap_rollout"):
        init_chat_model(model.name)  # outside a rollout a name says nothing about the endpoint
    llm = init_chat_model(model, max_tokens=3)  # the model itself works anywhere
    assert isinstance(llm, ChatOpenAI) and (llm.model_name, llm.temperature) == (model.name, 1.0)
    assert llm.openai_api_base == model.inference_base_url and llm.root_async_client is model.openai_client()
    assert (await llm.ainvoke("Hi")).content is not None
    with pytest.raises(TypeError, match="ART model first"):
        wrap_rollout(lambda: None)  # type: ignore[arg-type]

    names = {}

    @wrap_rollout(model)
    async def rollout():
        names["other"] = init_chat_model("something-else").model_name  # ART's rule: the rollout's model
        names["pinned"] = init_chat_model(f"{model.name}@0").model_name  # a step of it is sent as asked
        return names

    with pytest.raises(TypeError, match="returned dict"):
        await rollout()
    assert names == {"other": model.name, "pinned": f"{model.name}@0"}


async def test_wrap_rollout_groups_train_two_steps(served):
    model, backend = served

    @wrap_rollout(model)
    async def rollout(i: int) -> None:  # the reward set on the captured trajectory instead
        agent = create_agent(forcing_first_turn(init_chat_model(model.name, max_tokens=40)), [weather])
        await agent.ainvoke({"messages": QUESTION}, {"recursion_limit": 6})
        art.current_trajectory(require=True).reward = float(i)

    for step in range(2):
        group = await art.TrajectoryGroup(rollout(i) for i in range(2))
        assert not group.exceptions and [t.reward for t in group] == [0.0, 1.0]
        choices = [c for t in group for c in t.messages_and_choices if is_choice(c)]
        assert len(choices) >= 4 and all(s == step for t in group for s in sampled_steps(t))
        result = await backend.train(model, [group], learning_rate=1e-3)
        assert result.step == step + 1
        assert result.metrics["trained_tokens"] == sum(len(c.token_ids) for c in choices)
        assert not [k for k in result.metrics if k.startswith("skipped/")], result.metrics


async def test_langchains_create_agent_trains_too(served):
    """langgraph 1.x's recommended agent, where the `langchain` package is installed."""
    agents = pytest.importorskip("langchain.agents")
    model = served[0]

    @wrap_rollout(model)
    async def rollout() -> art.Trajectory:
        agent = agents.create_agent(init_chat_model(model.name, max_tokens=8), [weather])
        await agent.ainvoke({"messages": QUESTION})
        return art.Trajectory(messages_and_choices=[], reward=1.0)

    trajectory = await rollout()
    choices = [c for c in trajectory.messages_and_choices if is_choice(c)]
    assert trajectory.reward == 1.0 and choices and all(c.token_ids for c in choices)
    assert [t["function"]["name"] for t in trajectory.tools] == ["weather"]
    assert_trains_whole(trajectory)
