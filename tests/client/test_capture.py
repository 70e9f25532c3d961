"""Automatic trajectory capture (`art.capture_auto_trajectory`) against a real loopback server.

Agents talk to a registered tiny model through the official `openai` client and through
LangChain's `ChatOpenAI`; the captured choices must be exactly the ones the server sent
(token ids, logprobs), placed in the right conversation, and train without being skipped.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections import Counter
from pathlib import Path

import openai
import pytest
import pytest_asyncio

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


async def test_the_readme_snippet_runs_as_written(model):
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    section = readme[readme.index("## Capturing an existing agent's calls"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    trajectory = await namespace["rollout"](model, "Say yes.")
    assert [type(i).__name__ for i in trajectory.messages_and_choices] == ["dict", "Choice"]
    assert trajectory.reward == float("yes" in trajectory.messages_and_choices[1].message.content.lower())
