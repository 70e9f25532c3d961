"""An OpenAI Agents SDK agent, written as the SDK documents it, trains through `art.trajectory`.

Only our client and model name are passed in (`OpenAIResponsesModel`): the SDK talks to our
`/v1/responses`, capture records each call as the chat turn it stands for, and the tiny model
trains on exactly the ids it sampled. A random model never calls a tool by itself, so the first
turn is `tool_choice="required"`; the SDK resets it to "auto" after the call, as it does by
default, and the second turn answers with the agent's `output_type` (structured output, which the
server's grammar ends: an answer cut at max_tokens is "incomplete", and the SDK raises on it).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Literal

import pytest
import pytest_asyncio
from pydantic import BaseModel
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

import art
from art.training.sequences import SEQUENCE_BREAK, sequences_of_trajectory

pytestmark = pytest.mark.integration

set_tracing_disabled(True)  # the SDK's own trace export goes to OpenAI; nothing may leave this machine
INSTRUCTIONS = "Pick a letter with the tool, then say which one you picked."
REWARDS = (0.0, 1.0, 0.25)
"""None at the group's mean: a zero advantage trains nothing, and every token must train."""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(tiny_model_path, tmp_path_factory):
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("agents")))
    model = art.TrainableModel(name="tiny", project="agents", base_model=str(tiny_model_path))
    await model.register(backend)
    yield model, backend
    await backend.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


class Picked(BaseModel):
    letter: Literal["a", "b"]


def picker(model: art.Model, picked: list[str], **settings) -> Agent:
    """The agent as the SDK's docs write one; `picked` records what its tool was called with."""

    @function_tool
    def pick(letter: Literal["a", "b"]) -> str:
        """Pick a letter."""
        picked.append(letter)
        return f"you picked {letter}"

    return Agent(name="picker", instructions=INSTRUCTIONS, tools=[pick], output_type=Picked,
                 model=OpenAIResponsesModel(model=model.name, openai_client=model.openai_client()),
                 model_settings=ModelSettings(tool_choice="required", max_tokens=40), **settings)


def choices_of(trajectory: art.Trajectory) -> list:
    return [i for h in [trajectory, *trajectory.additional_histories] for i in h.messages_and_choices
            if not isinstance(i, dict)]


def assert_one_exact_sequence(trajectory: art.Trajectory, one: bool = True) -> None:
    """Every token trained is one the sampler produced, nothing skipped; with `one`, in one
    sequence: each turn's prompt extends the last turn's prompt and answer."""
    issues: Counter = Counter()
    sequences = sequences_of_trajectory(trajectory, issues)
    if not one:
        del issues[SEQUENCE_BREAK]  # a text answer cut at max tokens re-tokenises; still trained
    assert not issues and (len(sequences) == 1 or not one), issues
    assert sum(s.num_trained for s in sequences) == sum(len(c.token_ids) for c in choices_of(trajectory)) > 0


async def test_agent_run_is_captured_as_one_conversation(served, tokenizer):
    model, picked = served[0], []
    agent = picker(model, picked)
    results = []

    async def run():  # the SDK's quickstart, nothing of ours inside
        results.append(await Runner.run(agent, "Pick one.", max_turns=3))

    trajectory = await art.trajectory(run())

    assert trajectory.logs == [] and trajectory.additional_histories == []
    system, user, call_turn, tool, answer = trajectory.messages_and_choices
    assert system == {"role": "system", "content": INSTRUCTIONS} and user == {"role": "user", "content": "Pick one."}
    [call] = call_turn.message.tool_calls
    assert call_turn.finish_reason == "tool_calls" and call_turn.message.content is None
    assert call.function.name == "pick" and picked == [json.loads(call.function.arguments)["letter"]]
    assert tool == {"role": "tool", "tool_call_id": call.id, "content": f"you picked {picked[0]}"}
    assert Picked.model_validate_json(answer.message.content) == results[0].final_output
    assert answer.finish_reason == "stop"
    # The ids are the sampler's: they decode to what the agent was given.
    assert call.function.arguments in tokenizer.decode(call_turn.token_ids)
    assert tokenizer.decode(answer.token_ids, skip_special_tokens=True) == answer.message.content
    assert answer.prompt_token_ids[:len(call_turn.prompt_token_ids)] == call_turn.prompt_token_ids
    assert len(answer.logprobs.content) == len(answer.token_ids) and answer.step == call_turn.step == 0
    assert [t["function"]["name"] for t in trajectory.tools] == ["pick"]
    assert_one_exact_sequence(trajectory)


async def test_streamed_run_is_captured(served):
    model, picked = served[0], []
    agent = picker(model, picked, tool_use_behavior="stop_on_first_tool")
    finals = []

    async def run():
        result = Runner.run_streamed(agent, "Pick one.", max_turns=2)
        async for event in result.stream_events():
            if event.type == "raw_response_event" and event.data.type == "response.completed":
                finals.append(event.data.response)

    trajectory = await art.trajectory(run())

    [completed] = finals
    [choice] = choices_of(trajectory)
    assert trajectory.logs == [] and len(trajectory.messages_and_choices) == 3
    assert choice.token_ids == completed.model_extra["token_ids"]
    assert choice.prompt_token_ids == completed.model_extra["prompt_token_ids"]
    assert choice.message.tool_calls[0].function.arguments == completed.output[0].arguments
    assert choice.message.tool_calls[0].id == completed.output[0].call_id and len(picked) == 1


async def test_agent_trajectories_train_two_steps(served):
    model, backend = served
    picked: list[str] = []
    agent = picker(model, picked)

    async def rollout(reward: float) -> None:
        await Runner.run(agent, "Pick one.", max_turns=3)
        art.current_trajectory(require=True).reward = reward

    for step in (1, 2):
        group = await art.trajectory_group(art.trajectory(rollout(r)) for r in REWARDS)
        assert [t.reward for t in group] == list(REWARDS)
        sampled = [c for t in group for c in choices_of(t)]
        assert len(sampled) == 6 and {c.step for c in sampled} == {step - 1}  # the weights that sampled them
        for trajectory in group:
            assert_one_exact_sequence(trajectory)
        result = await backend.train(model, [group], learning_rate=1e-3)
        assert result.step == step == await model.get_step()
        assert result.metrics["trained_tokens"] == sum(len(c.token_ids) for c in sampled)
        assert not [k for k in result.metrics if k.startswith("skipped/")], result.metrics


async def test_plain_responses_calls_are_captured_as_chat_choices(served):
    """The `openai` client's own Responses calls: a whole one, a streamed one that continues
    it, and a stream closed early (noted, not recorded)."""
    model = served[0]
    client = model.openai_client()
    ask = {"model": model.name, "instructions": "Answer briefly.", "max_output_tokens": 5}
    seen = {}

    async def agent():
        seen["whole"] = await client.responses.create(input="Name a color.", extra_body={"seed": 2}, **ask)
        follow_up = [{"role": "user", "content": "Name a color."},
                     *[item.model_dump(exclude_unset=True) for item in seen["whole"].output],
                     {"role": "user", "content": "Another one."}]
        stream = await client.responses.create(input=follow_up, stream=True, **ask)
        seen["events"] = [event async for event in stream]
        cut = await client.responses.create(input="Count.", stream=True, **{**ask, "max_output_tokens": 60})
        await anext(aiter(cut))
        await cut.close()

    trajectory = await art.trajectory(agent())

    assert trajectory.logs == ["a streamed response ended before it completed; not recorded"]
    system, first_user, first, second_user, second = trajectory.messages_and_choices
    assert (system["content"], first_user["content"], second_user["content"]) == (
        "Answer briefly.", "Name a color.", "Another one.")
    # The whole call's Choice is the one the same seeded chat request returns.
    chat = await client.chat.completions.create(
        model=model.name, max_tokens=5, seed=2,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}])
    got, want = first.model_dump(), chat.choices[0].model_dump()
    got_lp, want_lp = got.pop("logprobs")["content"], want.pop("logprobs")["content"]
    want.pop("stop_reason")  # vLLM's chat field (the stop string matched); a Response has none
    assert got == want
    assert [e["logprob"] for e in got_lp] == pytest.approx([e["logprob"] for e in want_lp], abs=1e-4)
    # The streamed one is what its last event carried.
    final = seen["events"][-1].response
    assert second.token_ids == final.model_extra["token_ids"] and second.message.content == final.output_text
    assert second.finish_reason == ("length" if final.status == "incomplete" else "stop")
    assert trajectory.additional_histories == []
    assert_one_exact_sequence(trajectory, one=False)
    # Each recorded call is in exchanges, whole: the request as sent, the Response received.
    whole, streamed = trajectory.exchanges.responses
    assert trajectory.exchanges.chat_completions == []
    assert whole.request["input"] == "Name a color." and whole.model == model.name
    assert whole.response.id == seen["whole"].id and whole.response.output_text == seen["whole"].output_text
    assert streamed.request["stream"] is True and streamed.response.id == final.id
    assert whole.start_time <= whole.end_time <= streamed.start_time <= streamed.end_time
