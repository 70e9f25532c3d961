"""Trajectory validation and serialisation, and awaiting a TrajectoryGroup of coroutines."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall, Function
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob
from pydantic import BaseModel, ConfigDict, ValidationError

from art.errors import TrajectoryError
from art.trajectories import History, Trajectory, TrajectoryGroup, is_choice


def make_choice(content: str = "hi", **extra) -> Choice:
    logprobs = ChoiceLogprobs(
        content=[ChatCompletionTokenLogprob(token="hi", logprob=-0.5, bytes=None, top_logprobs=[])]
    )
    return Choice(
        index=0,
        finish_reason="stop",
        message=ChatCompletionMessage(role="assistant", content=content),
        logprobs=logprobs,
        **({"token_ids": [1, 2], "prompt_token_ids": [7, 8, 9]} | extra),
    )


def test_choices_and_dicts_keep_their_types():
    choice = make_choice()
    choice_shaped_dict = {"role": "assistant", "content": "x", "finish_reason": "stop", "index": 0}
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice, choice_shaped_dict])
    assert traj.messages_and_choices[1] is choice
    assert isinstance(traj.messages_and_choices[0], dict)
    assert isinstance(traj.messages_and_choices[2], dict)
    traj.messages_and_choices.append(make_choice("again"))
    assert is_choice(traj.messages_and_choices[-1])


def test_messages_turns_choices_into_assistant_dicts_with_tool_calls():
    call = ChatCompletionMessageToolCall(id="c1", type="function", function=Function(name="f", arguments="{}"))
    with_tools = Choice(
        index=0,
        finish_reason="tool_calls",
        message=ChatCompletionMessage(role="assistant", content=None, tool_calls=[call]),
    )
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, make_choice("a"), with_tools])
    assert traj.messages() == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]


def test_choice_of_another_class_is_accepted():
    class OtherMessage(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: str
        content: str | None

    class OtherChoice(BaseModel):
        model_config = ConfigDict(extra="allow")
        index: int
        finish_reason: str
        message: OtherMessage
        logprobs: None = None

    other = OtherChoice(index=0, finish_reason="stop", message=OtherMessage(role="assistant", content="o"), token_ids=[3])
    traj = Trajectory(messages_and_choices=[other])
    item = traj.messages_and_choices[0]
    assert is_choice(item) and item.token_ids == [3]
    assert traj.messages() == [{"role": "assistant", "content": "o"}]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_reward_must_be_finite_and_error_names_the_field(bad):
    with pytest.raises(ValidationError, match="reward"):
        Trajectory(reward=bad)
    traj = Trajectory(reward=1.0)
    with pytest.raises(ValidationError, match="reward must be a finite number"):
        traj.reward = bad


def test_bad_items_get_a_clear_error():
    with pytest.raises(ValidationError, match="not a Choice"):
        Trajectory(messages_and_choices=[make_choice().message])
    with pytest.raises(ValidationError, match="without a 'role'"):
        Trajectory(messages_and_choices=[{"content": "no role"}])


def test_finish_log_and_for_logging_round_trip():
    traj = Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, make_choice()],
        reward=0.5,
        metrics={"correct": True, "turns": 2},
        metadata={"scenario": "s1", "seed": None},
        additional_histories=[History(messages_and_choices=[make_choice("side")])],
    )
    traj.log("did a thing")
    assert traj.end_time is None
    assert traj.finish() is traj and traj.end_time is not None
    data = json.loads(json.dumps(traj.for_logging()))
    dumped = data["messages_and_choices"][1]
    assert dumped["token_ids"] == [1, 2] and dumped["prompt_token_ids"] == [7, 8, 9]
    assert dumped["logprobs"]["content"][0]["logprob"] == -0.5
    assert data["logs"] == ["did a thing"] and data["metrics"] == {"correct": True, "turns": 2}
    back = Trajectory.from_logging(data)
    assert isinstance(back.messages_and_choices[1], Choice) and back.messages_and_choices[1].token_ids == [1, 2]
    assert isinstance(back.additional_histories[0].messages_and_choices[0], Choice)
    assert back.messages_and_choices[0] == {"role": "user", "content": "q"}


def test_defaults_are_not_shared():
    a, b = Trajectory(), Trajectory()
    a.log("x")
    a.metrics["m"] = 1
    assert b.logs == [] and b.metrics == {}


async def rollout(reward: float, started: list, release: asyncio.Event) -> Trajectory:
    started.append(reward)
    await release.wait()
    if reward < 0:
        raise ValueError(f"bad rollout {reward}")
    return Trajectory(reward=reward).finish()


async def test_group_from_generator_runs_concurrently_and_keeps_order():
    started: list = []
    release = asyncio.Event()
    group = TrajectoryGroup(rollout(r, started, release) for r in [3.0, 1.0, 2.0])
    assert len(group) == 3  # the rollouts it will run, as ART counts them
    task = asyncio.ensure_future(_await(group))
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(started) == [1.0, 2.0, 3.0]  # all started before any could finish
    release.set()
    assert await task is group
    assert [t.reward for t in group] == [3.0, 1.0, 2.0] and len(group) == 3


async def _await(group):
    return await group


async def test_group_keeps_exceptions_aside():
    release = asyncio.Event()
    release.set()
    group = await TrajectoryGroup([rollout(1.0, [], release), rollout(-1.0, [], release)], metadata={"k": "v"})
    assert [t.reward for t in group] == [1.0]
    (record,) = group.exceptions
    assert record.type == "ValueError" and record.message == "bad rollout -1.0"
    assert "Traceback" in record.traceback and "bad rollout" in record.traceback
    data = json.loads(json.dumps(group.for_logging()))
    assert data["exceptions"][0]["type"] == "ValueError" and data["metadata"] == {"k": "v"}


async def test_awaiting_twice_is_an_error_but_a_finished_group_awaits_to_itself():
    release = asyncio.Event()
    release.set()
    group = TrajectoryGroup([rollout(1.0, [], release)])
    await group
    with pytest.raises(RuntimeError, match="already awaited"):
        await group
    ready = TrajectoryGroup([Trajectory(reward=1.0), Trajectory(reward=2.0)])
    assert await ready is ready and await ready is ready and len(ready) == 2


def test_group_construction_options():
    t = Trajectory(reward=1.0)
    group = TrajectoryGroup(trajectories=[t, ValueError("x")], exceptions=[KeyError("y")], metrics={"m": 1})
    assert group.trajectories[0] is t and list(group) == [t]
    assert [e.type for e in group.exceptions] == ["KeyError", "ValueError"]
    assert group.metrics == {"m": 1}
    copy = TrajectoryGroup.model_validate(group.model_dump())
    assert copy.trajectories[0].reward == 1.0
    with pytest.raises(TrajectoryError, match="not a single one"):
        TrajectoryGroup(t)  # type: ignore[arg-type]
