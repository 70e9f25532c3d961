"""Automatic trajectory capture (`art.capture_auto_trajectory`) against a real loopback server.

Agents talk to a registered tiny model through the official `openai` client and through
LangChain's `ChatOpenAI`; the captured choices must be exactly the ones the server sent
(token ids, logprobs), placed in the right conversation, and train without being skipped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from openai.types.chat.chat_completion import ChatCompletion, Choice
from pydantic import ValidationError

import art
from art.errors import CaptureError
from art.training.sequences import SEQUENCE_BREAK, sequences_of_trajectory

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "auto_capture.py"
SYSTEM = {"role": "system", "content": "Answer briefly."}
PICK = {"type": "function", "function": {
    "name": "pick", "description": "Pick a letter.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string", "enum": ["a", "b"]}},
                   "required": ["x"]}}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(tiny_model_path, tmp_path_factory):
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("capture")))
    model = art.TrainableModel(name="tiny", project="capture", base_model=str(tiny_model_path))
    await model.register(backend)
    yield model, backend
    await backend.close()


@pytest.fixture
def model(served):
    return served[0]


def chunk_parts(chunks) -> dict:
    """What a streaming caller received for choice 0, concatenated by hand."""
    parts = {"content": "", "token_ids": [], "logprobs": [], "finish_reason": None, "prompt_token_ids": None}
    for chunk in chunks:
        parts["prompt_token_ids"] = parts["prompt_token_ids"] or (chunk.model_extra or {}).get("prompt_token_ids")
        for c in chunk.choices:
            assert c.index == 0
            parts["content"] += c.delta.content or ""
            parts["token_ids"] += (c.model_extra or {}).get("token_ids") or []
            parts["logprobs"] += [e.model_dump() for e in (c.logprobs.content if c.logprobs else None) or []]
            parts["finish_reason"] = c.finish_reason or parts["finish_reason"]
    return parts


def assert_trains_whole(trajectory: art.Trajectory) -> None:
    """Every captured choice becomes trained tokens: nothing is skipped."""
    issues: Counter = Counter()
    sequences = sequences_of_trajectory(trajectory, issues)
    del issues[SEQUENCE_BREAK]  # a new sequence, still trained
    assert not issues, issues
    choices = [i for h in [trajectory, *trajectory.additional_histories] for i in h.messages_and_choices
               if not isinstance(i, dict)]
    assert sum(s.num_trained for s in sequences) == sum(len(c.token_ids) for c in choices)


async def test_three_calls_two_conversations_streamed_and_not(model):
    client = model.openai_client()
    seen = {}

    async def agent():  # written as if no capture existed
        messages = [SYSTEM, {"role": "user", "content": "Name a color."}]
        seen["first"] = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=5)
        messages += [seen["first"].choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Another one."}]
        seen["second_request"] = list(messages)
        stream = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=6,
                                                      seed=11, stream=True, stream_options={"include_usage": True})
        seen["chunks"] = [chunk async for chunk in stream]
        other = [{"role": "user", "content": "Count to three."}]
        seen["third"] = await client.chat.completions.create(model=model.name, messages=other, max_tokens=4)
        art.auto_trajectory(required=True).reward = 0.5

    trajectory = await art.capture_auto_trajectory(agent())

    assert trajectory.reward == 0.5 and trajectory.end_time is not None and trajectory.logs == []
    first, second_user, second, *rest = trajectory.messages_and_choices[2:]
    assert trajectory.messages_and_choices[:2] == [SYSTEM, {"role": "user", "content": "Name a color."}]
    assert second_user == {"role": "user", "content": "Another one."} and rest == []
    assert first.model_dump() == seen["first"].choices[0].model_dump()
    [other] = trajectory.additional_histories
    assert other.messages_and_choices[0] == {"role": "user", "content": "Count to three."}
    assert other.messages_and_choices[1].model_dump() == seen["third"].choices[0].model_dump()
    assert len(other.messages_and_choices) == 2

    # The streamed choice is exactly what the stream carried ...
    parts = chunk_parts(seen["chunks"])
    assert len(second.token_ids) == len(parts["token_ids"]) >= 1
    assert second.token_ids == parts["token_ids"] and second.message.content == parts["content"]
    assert [e.model_dump() for e in second.logprobs.content] == parts["logprobs"]
    assert second.prompt_token_ids == parts["prompt_token_ids"] and second.finish_reason == parts["finish_reason"]
    # ... and the Choice the same seeded request returns whole (logprobs up to float noise).
    whole = (await client.chat.completions.create(model=model.name, messages=seen["second_request"],
                                                  max_tokens=6, seed=11)).choices[0]
    got, want = second.model_dump(), whole.model_dump()
    got_lp, want_lp = got.pop("logprobs")["content"], want.pop("logprobs")["content"]
    assert got == want
    assert [e["token"] for e in got_lp] == [e["token"] for e in want_lp]
    assert [e["logprob"] for e in got_lp] == pytest.approx([e["logprob"] for e in want_lp], abs=1e-4)

    # Each call is also kept whole, in the order it finished: request as sent, answer as received.
    exchanges = trajectory.exchanges.chat_completions
    assert [e.request["messages"][-1]["content"] for e in exchanges] == ["Name a color.", "Another one.",
                                                                         "Count to three."]
    assert exchanges[0].response.model_dump() == seen["first"].model_dump()
    assert exchanges[1].response.choices[0].model_dump() == second.model_dump()
    assert exchanges[1].response.usage == seen["chunks"][-1].usage is not None  # include_usage's last chunk
    assert all(e.model == model.name and e.start_time <= e.end_time for e in exchanges)

    assert_trains_whole(trajectory)


async def test_captured_trajectories_train_a_step(model, served):
    backend = served[1]
    client = model.openai_client()

    async def agent(text: str, reward: float):
        messages = [{"role": "user", "content": text}]
        reply = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=4)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        stream = await client.chat.completions.create(
            model=model.name, messages=[*messages, {"role": "user", "content": "Go on."}], max_tokens=4, stream=True)
        async for _ in stream:
            pass
        art.auto_trajectory(required=True).reward = reward

    group = await art.TrajectoryGroup(art.capture_auto_trajectory(agent(t, r)) for t, r in [("Hi.", 0.0), ("Yo.", 1.0)])
    assert not group.exceptions and [t.reward for t in group.trajectories] == [0.0, 1.0]
    sampled = sum(len(i.token_ids) for t in group for i in t.messages_and_choices if not isinstance(i, dict))
    await backend.check_training_input(model, [group])
    result = await backend.train(model, [group], learning_rate=1e-3)
    assert result.step == 1
    assert result.metrics["trained_tokens"] == sampled
    # A turn whose prompt re-tokenises the previous reply differently is a new sequence, still trained.
    assert not [k for k in result.metrics if k.startswith("skipped/")], result.metrics


async def test_tool_call_turns_stream_and_join_their_conversation(model):
    client = model.openai_client()
    question = [{"role": "user", "content": "Pick one."}]
    args = {"model": model.name, "tools": [PICK], "tool_choice": "required", "max_tokens": 40, "seed": 3}

    async def agent():
        stream = await client.chat.completions.create(messages=question, stream=True, **args)
        call = {"id": None, "name": "", "arguments": ""}
        async for chunk in stream:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        # The call written back re-spaced and without content, as agent libraries do.
        written = {"name": call["name"], "arguments": call["arguments"].replace(" ", "")}
        messages = [*question, {"role": "assistant", "tool_calls": [{"id": call["id"], "type": "function",
                                                                      "function": written}]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
        await client.chat.completions.create(model=model.name, messages=messages, tools=[PICK], max_tokens=3)

    trajectory = await art.capture_auto_trajectory(agent())
    assert trajectory.additional_histories == [] and trajectory.tools == [PICK], trajectory.logs
    # The written-back assistant message is the streamed Choice itself, so only the tool result is new.
    user, streamed, tool, answer = trajectory.messages_and_choices
    assert tool == {"role": "tool", "tool_call_id": streamed.message.tool_calls[0].id, "content": "ok"}
    assert answer.finish_reason == "length"
    whole = (await client.chat.completions.create(messages=question, **args)).choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert streamed.message.content is None and whole.message.content is None
    [call], [whole_call] = streamed.message.tool_calls, whole.message.tool_calls
    assert call.function.model_dump() == whole_call.function.model_dump()
    assert streamed.token_ids == whole.token_ids and streamed.prompt_token_ids == whole.prompt_token_ids
    assert_trains_whole(trajectory)


async def test_captures_stay_apart_and_only_inside(model):
    client = model.openai_client()

    async def ask(text: str):
        await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": text}],
                                             max_tokens=2)
        return art.auto_trajectory()

    assert art.auto_trajectory() is None
    with pytest.raises(CaptureError):
        art.auto_trajectory(required=True)
    await ask("outside")  # not recorded anywhere
    one, two = await asyncio.gather(art.capture_auto_trajectory(ask("one")), art.capture_auto_trajectory(ask("two")))
    assert one.messages()[0]["content"] == "one" and len(one.messages_and_choices) == 2
    assert two.messages()[0]["content"] == "two" and len(two.messages_and_choices) == 2
    assert one.additional_histories == two.additional_histories == []

    with art.AutoTrajectoryContext() as trajectory:  # the context-manager form
        assert art.auto_trajectory() is trajectory
        await ask("three")
    assert art.auto_trajectory() is None and trajectory.messages()[0]["content"] == "three"

    with art.AutoTrajectoryContext() as trajectory:  # a failed call is noted, not recorded
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert trajectory.messages_and_choices == [] and "HTTP 404" in trajectory.logs[0]


def test_sync_client_and_streams_cut_short(model):
    """The sync client (another send); a stream closed early or left unread is noted, not recorded."""
    ask = {"model": model.name, "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 6}
    with openai.OpenAI(base_url=model.inference_base_url, api_key="x", max_retries=0) as client:
        with art.AutoTrajectoryContext() as trajectory:
            with client.chat.completions.create(**ask, stream=True) as stream:
                text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            with client.chat.completions.create(**{**ask, "max_tokens": 200}, stream=True) as stream:
                next(iter(stream))  # the first chunk only, then closed long before token 200
            client.chat.completions.create(**ask, stream=True)  # never read
    [choice] = [i for i in trajectory.messages_and_choices if not isinstance(i, dict)]
    assert choice.message.content == text and len(choice.token_ids) == len(choice.logprobs.content) >= 1
    assert trajectory.additional_histories == []
    assert trajectory.logs == ["a streamed chat completion ended before its choice finished; not recorded"] * 2


async def test_langchain_chat_openai_is_captured(model):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI  # the `test` extra

    llm = ChatOpenAI(model=model.name, base_url=model.inference_base_url, api_key="x",
                                      max_tokens=5, max_retries=0, logprobs=True)
    seen = {}

    async def agent():  # plain LangChain code
        history = [SystemMessage("Answer briefly."), HumanMessage("Name a fruit.")]
        seen["first"] = await llm.ainvoke(history)
        history += [seen["first"], HumanMessage("And another?")]
        seen["second"] = "".join([chunk.content async for chunk in llm.astream(history)])
        seen["third"] = await llm.ainvoke([HumanMessage("Say hi.")])

    trajectory = await art.capture_auto_trajectory(agent())
    trajectory.reward = 1.0

    assert trajectory.logs == []
    items = trajectory.messages_and_choices
    assert [type(i).__name__ for i in items] == ["dict", "dict", "Choice", "dict", "Choice"]
    assert items[1] == {"role": "user", "content": "Name a fruit."} and items[3]["content"] == "And another?"
    assert items[2].message.content == seen["first"].content and items[4].message.content == seen["second"]
    received = [e["logprob"] for e in seen["first"].response_metadata["logprobs"]["content"]]
    assert [e.logprob for e in items[2].logprobs.content] == received
    [other] = trajectory.additional_histories
    assert other.messages_and_choices[1].message.content == seen["third"].content
    assert_trains_whole(trajectory)


async def test_the_example_agent_is_captured_whole(model):
    """examples/auto_capture.py's rollout: three plain `openai` calls, two conversations."""
    spec = importlib.util.spec_from_file_location("auto_capture", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    trajectory = await example.rollout(model, "Is zero even?")
    kinds = [type(i).__name__ for i in trajectory.messages_and_choices]
    assert kinds == ["dict", "dict", "Choice", "dict", "Choice"], trajectory.logs
    [checker] = trajectory.additional_histories
    assert [type(i).__name__ for i in checker.messages_and_choices] == ["dict", "Choice"]
    assert trajectory.reward == example.score(trajectory.messages_and_choices[-1].message.content)
    assert_trains_whole(trajectory)


# -- servers that are not ours: ART's unit test shapes, a scripted loopback server ---------------


def sse(chunks: list[dict], done: bool = True) -> bytes:
    events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return (events + ("data: [DONE]\n\n" if done else "")).encode()


def chunk(delta: dict, logprob: float | None = None, finish_reason: str | None = None) -> dict:
    logprobs = None if logprob is None else {
        "content": [{"token": f"t{logprob}", "logprob": logprob, "bytes": None, "top_logprobs": []}]}
    return {"id": "chunked", "object": "chat.completion.chunk", "created": 7, "model": "scripted",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


WHOLE = {"id": "whole", "object": "chat.completion", "created": 5, "model": "scripted", "usage": None,
         "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": None,
                      "message": {"role": "assistant", "content": "Hello!", "tool_calls": []},
                      "logprobs": {"content": [{"token": "Hello", "logprob": -0.25, "bytes": None,
                                                "top_logprobs": []}]}}]}
# A vLLM-style tool-call stream that repeats the call's id and name with each delta, sends no
# finish_reason at all, then `[DONE]`, with a content type that is not text/event-stream.
CALL = {"id": "call-9", "type": "function", "index": 0, "function": {"name": "pick", "arguments": '{"x": '}}
TOOL_STREAM = sse([chunk({"role": "assistant", "content": ""}), chunk({"tool_calls": [CALL]}, -0.5),
                   chunk({"tool_calls": [{**CALL, "function": {"name": "pick", "arguments": '"a"}'}}]}, -0.25)])
TEXT_STREAM = sse([chunk({"role": "assistant", "content": "Hi"}, -0.5), chunk({"content": " there"}, -0.75)])
CUT_STREAM = sse([chunk({"role": "assistant", "content": "Hi"}, -0.5)], done=False)
REPLIES = {  # the last user message -> (content type, body)
    "whole": ("application/json", json.dumps(WHOLE).encode()),
    "tools": ("application/octet-stream", TOOL_STREAM),
    "text": ("text/plain", TEXT_STREAM),
    "cut": ("text/event-stream", CUT_STREAM),
}


class ScriptedHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        content_type, reply = REPLIES[body["messages"][-1]["content"]]
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def scripted():
    """An OpenAI-compatible server that answers canned bodies, like ART's unit test's server."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x",
                             max_retries=0)
    server.shutdown()
    thread.join()


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def drain(stream) -> None:
    async for _ in stream:
        pass


async def test_streams_end_at_done_whatever_their_content_type(scripted):
    tools = [PICK]

    async def agent():
        await scripted.chat.completions.create(model="scripted", messages=ask("whole"), tools=tools)
        await drain(await scripted.chat.completions.create(model="scripted", messages=ask("tools"), tools=tools,
                                                           tool_choice="required", stream=True))
        await drain(await scripted.chat.completions.create(model="scripted", messages=ask("text"), stream=True))
        await drain(await scripted.chat.completions.create(model="scripted", messages=ask("cut"), stream=True))
        art.current_trajectory(require=True).reward = 1.0

    trajectory = await art.trajectory(agent())

    assert trajectory.reward == 1.0
    assert trajectory.logs == ["a streamed chat completion ended before its choice finished; not recorded"]
    whole, tools_call, text = [h.messages_and_choices[1] for h in [trajectory, *trajectory.additional_histories]]
    assert whole == Choice.model_validate(WHOLE["choices"][0])
    # Never told why they finished, the streams say what the model did.
    assert tools_call.finish_reason == "tool_calls" and text.finish_reason == "stop"
    assert text.message.content == "Hi there" and [e.logprob for e in text.logprobs.content] == [-0.5, -0.75]
    [call] = tools_call.message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("call-9", "pick", '{"x": "a"}')
    assert tools_call.message.content is None and [e.logprob for e in tools_call.logprobs.content] == [-0.5, -0.25]

    # The exchanges: one per recorded call, the stream rebuilt as ART rebuilds it (its finish "stop").
    exchanges = trajectory.exchanges.chat_completions
    assert len(exchanges) == 3 and all(e.model == "scripted" for e in exchanges)
    assert exchanges[0].request == {"model": "scripted", "messages": ask("whole"), "tools": tools}
    assert exchanges[0].response == ChatCompletion.model_validate(WHOLE)
    streamed = exchanges[1].response
    assert (streamed.id, streamed.created, streamed.object) == ("chunked", 7, "chat.completion")
    assert streamed.choices[0] == Choice.model_validate({**tools_call.model_dump(), "finish_reason": "stop"})
    assert exchanges[2].response.choices[0] == text


async def test_exchanges_are_the_calls_as_sent_and_rebuild_the_turns(scripted):
    request = ask("whole")
    trajectory = await art.trajectory(scripted.chat.completions.create(model="scripted", messages=request))
    [exchange] = trajectory.exchanges.chat_completions
    request[0]["content"] = "edited by the agent later"  # the exchange keeps its own copy
    assert exchange.request["messages"][0]["content"] == "whole"
    exchange.request["model"] = "changed"  # mutable, as ART's
    assert trajectory.exchanges.chat_completions[0].model == "changed"
    assert not art.Trajectory().exchanges and art.Trajectory().exchanges.chat_completions == []
    # Dumped as ART dumps it; logged and trained without them (the turns hold the ids).
    assert set(trajectory.model_dump()) >= {"exchanges", "messages_and_choices"}
    assert "exchanges" not in trajectory.for_logging()
    # ART's representation, exchanges alone, gives back the same turns that train.
    exchanges_only = trajectory.model_dump(include={"exchanges", "reward"})
    rebuilt = art.Trajectory.model_validate(exchanges_only)
    assert rebuilt.messages_and_choices == trajectory.messages_and_choices
    assert rebuilt.messages_and_choices[-1].message.content == exchange.response.choices[0].message.content


async def test_trajectory_scope_names(scripted):
    async def agent():
        outer = art.current_trajectory(require=True)
        assert art.current_trajectory(required=True) is outer is art.auto_trajectory()
        with art.no_capture():
            assert art.current_trajectory() is None
            with pytest.raises(CaptureError, match="current_trajectory"):
                art.current_trajectory(require=True)
            await scripted.chat.completions.create(model="scripted", messages=ask("whole"))  # not recorded
            inner = await art.trajectory(scripted.chat.completions.create(model="scripted", messages=ask("whole")))
        assert art.current_trajectory() is outer
        outer.metadata["inner"] = inner.messages_and_choices[0]["content"]

    assert art.current_trajectory() is None
    trajectory = await art.trajectory(agent())
    assert trajectory.messages_and_choices == [] and trajectory.metadata == {"inner": "whole"}
    assert trajectory.end_time is not None

    # A Task already runs in the context it was made in: nothing would be recorded, so it is refused.
    task = asyncio.ensure_future(asyncio.sleep(0))
    with pytest.raises(TypeError, match="coroutine itself"):
        await art.trajectory(task)
    with pytest.raises(TypeError, match="coroutine itself"):
        await art.capture_auto_trajectory(task)
    await task


async def test_trajectory_group_runs_rollouts_together(scripted):
    running, most = 0, 0

    async def rollout(text: str, reward: float) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)
        await scripted.chat.completions.create(model="scripted", messages=ask(text))
        art.current_trajectory(require=True).reward = reward
        running -= 1

    async def fails() -> art.Trajectory:
        raise ValueError("rollout failed")

    done = art.Trajectory(reward=9.0)
    shared = art.trajectory(rollout("whole", 2.0))
    group = await art.trajectory_group([art.trajectory(rollout("whole", 1.0)), done, shared, shared,
                                        fails()], return_exceptions=True, metadata={"scenario": "s1"},
                                       metrics={"m": 1}, logs=["built"])
    assert [t.reward for t in group] == [1.0, 9.0, 2.0, 2.0] and group.trajectories[2] is group.trajectories[3]
    assert most == 2  # the two rollouts ran at once (the shared one once)
    assert [e.message for e in group.exceptions] == ["rollout failed"]
    assert (group.metadata, group.metrics, group.logs) == ({"scenario": "s1"}, {"m": 1}, ["built"])
    assert all(len(t.messages_and_choices) == 2 for t in group if t is not done)

    # Without return_exceptions the first failure fails the group, and its siblings are cancelled.
    cancelled = asyncio.Event()

    async def slow() -> art.Trajectory:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return art.Trajectory()

    with pytest.raises(ValueError, match="rollout failed"):
        await art.trajectory_group([slow(), fails()])
    assert cancelled.is_set()

    # An enclosing capture does not record its rollouts' calls, nor do rollouts see it.
    async def agent():
        group = await art.trajectory_group([art.trajectory(rollout("whole", 0.5))])
        assert len(group.trajectories[0].messages_and_choices) == 2  # the rollout's own capture saw it
        assert art.current_trajectory() is not None

    outer = await art.trajectory(agent())
    assert outer.messages_and_choices == [] and not outer.exchanges

    with pytest.raises(TypeError, match="item 0 is a str"):
        await art.trajectory_group(["not a rollout"])
