"""`art.verifiers`: verifiers environments run unchanged and train on the sampler's exact ids.

The conversion tests feed RolloutOutput dicts shaped as verifiers writes them (flat tool calls,
JSON-string tool calls in saved outputs, steps with `tokens`). The environment tests run
verifiers' own SingleTurnEnv, a MultiTurnEnv subclass and a ToolEnv against a tiny model on a
loopback LocalBackend: the rubric's reward and metrics must land in each trajectory and every
assistant turn must be the Choice the server sent, the one verifiers itself recorded for that
rollout (its step's `tokens`), even though a group's rollouts run concurrently.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from typing import Literal

import pytest
import pytest_asyncio
from openai.types.chat.chat_completion import ChatCompletion, Choice

import art
from art.trajectories import ChatCompletionsExchange, ChatCompletionsRequest
from art.training.advantages import group_advantages
from art.training.sequences import SEQUENCE_BREAK, sequences_of_trajectory
from art.verifiers import (
    normalize_verifiers_rollout_output,
    normalize_verifiers_rollout_outputs,
    rollout_output_from_trajectory,
    rollout_outputs_from_trajectory_group,
    rollout_with_verifiers_environment,
    trajectory_from_verifiers_rollout,
    trajectory_group_from_verifiers_outputs,
    trajectory_group_with_verifiers_environment,
)

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Name a color."}


def make_choice(text: str | None, ids: list[int], prompt_ids: list[int] | None = None,
                tool_calls: list[dict] | None = None) -> Choice:
    return Choice.model_validate({
        "index": 0, "finish_reason": "tool_calls" if tool_calls else "stop",
        "message": {"role": "assistant", "content": text, "tool_calls": tool_calls},
        "logprobs": {"content": [{"token": f"<{i}>", "logprob": -0.25, "bytes": None, "top_logprobs": []}
                                 for i in ids]},
        "token_ids": ids, "prompt_token_ids": prompt_ids or [1, 2, 3], "step": 0})


def exchange(messages: list[dict], choice: Choice, completion_id: str, tools: list | None = None):
    now = datetime.now()
    request = {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    response = ChatCompletion.model_validate({"id": completion_id, "object": "chat.completion", "created": 0,
                                              "model": "m", "choices": [choice.model_dump()]})
    return ChatCompletionsExchange(request=ChatCompletionsRequest(request), response=response,
                                   start_time=now, end_time=now)


def trained_tokens(trajectory: art.Trajectory) -> int:
    issues: Counter = Counter()
    sequences = sequences_of_trajectory(trajectory, issues)
    del issues[SEQUENCE_BREAK]
    assert not issues, issues
    return sum(s.num_trained for s in sequences)


def choices_of(trajectory: art.Trajectory) -> list[Choice]:
    return [i for h in [trajectory, *trajectory.additional_histories] for i in h.messages_and_choices
            if isinstance(i, Choice)]


# -- conversion ----------------------------------------------------------------------------


def test_steps_rebuild_one_conversation_with_rubric_fields():
    a1 = {"role": "assistant", "content": "Red."}
    u2 = {"role": "user", "content": "Another?"}
    a2 = {"role": "assistant", "content": "Blue."}
    output = {
        "example_id": 7, "prompt": [SYSTEM, USER], "completion": [a1, u2, a2, {"role": "user", "content": "Done."}],
        "answer": "blue", "reward": 0.75, "is_completed": True, "is_truncated": False,
        "stop_condition": "max_turns_reached", "logs": ["env note", 3],
        "metrics": {"correct": 1.0, "num_turns": 2, "label": "x", "ok": True},
        "trajectory": [
            {"prompt": [SYSTEM, USER], "completion": [a1]},
            {"prompt": [SYSTEM, USER, a1, u2], "completion": [a2]},
        ],
    }
    trajectory = trajectory_from_verifiers_rollout(output)
    # Each message once, in order, and the final env message past the last step kept.
    assert trajectory.messages_and_choices == [SYSTEM, USER, a1, u2, a2, {"role": "user", "content": "Done."}]
    assert trajectory.additional_histories == []
    assert trajectory.reward == 0.75
    assert trajectory.metrics == {"correct": 1.0, "num_turns": 2, "ok": True}
    assert trajectory.metadata == {"verifiers_example_id": 7, "verifiers_is_completed": True,
                                   "verifiers_is_truncated": False, "verifiers_stop_condition": "max_turns_reached",
                                   "verifiers_answer": "blue"}
    assert trajectory.logs[0] == "env note" and "2 of 2 assistant turns have no sampled token ids" in trajectory.logs[1]
    assert trajectory.end_time is not None


def test_without_steps_prompt_and_completion_are_the_conversation():
    output = {"prompt": "Say hi.", "completion": "hi", "reward": None, "trajectory": []}
    trajectory = trajectory_from_verifiers_rollout(output)
    assert trajectory.messages_and_choices == [{"role": "user", "content": "Say hi."},
                                               {"role": "assistant", "content": "hi"}]
    assert trajectory.reward == 0.0 and trajectory.metadata["verifiers_example_id"] is None


def test_a_step_that_rewrites_the_conversation_starts_another_history():
    a1 = {"role": "assistant", "content": "Plan: red."}
    summary = [SYSTEM, {"role": "user", "content": "Summary so far: red. Continue."}]
    a2 = {"role": "assistant", "content": "Blue."}
    output = {"prompt": [SYSTEM, USER], "completion": [a1], "reward": 1.0,
              "trajectory": [{"prompt": [SYSTEM, USER], "completion": [a1]},
                             {"prompt": summary, "completion": [a2]}]}
    trajectory = trajectory_from_verifiers_rollout(output)
    assert trajectory.messages_and_choices == [SYSTEM, USER, a1]  # not glued to the rewritten prompt
    [other] = trajectory.additional_histories
    assert other.messages_and_choices == [*summary, a2]


def test_tool_calls_and_tool_defs_become_openai_shapes():
    flat = {"id": "c1", "name": "pick", "arguments": '{"color": "red"}'}
    tool_defs = [{"name": "pick", "description": "Pick a color.", "strict": True,
                  "parameters": {"type": "object", "properties": {"color": {"type": "string"}}}}]
    step_assistant = {"role": "assistant", "content": None, "tool_calls": [flat]}
    saved_assistant = {"role": "assistant", "content": "", "tool_calls": [json.dumps(flat)]}  # sanitize_tool_calls
    tool = {"role": "tool", "tool_call_id": "c1", "content": "you picked red"}
    output = {"prompt": [USER], "completion": [saved_assistant, tool], "tool_defs": tool_defs, "reward": 1,
              "trajectory": [{"prompt": [USER], "completion": [step_assistant]}]}
    trajectory = trajectory_from_verifiers_rollout(output)
    openai_call = {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": '{"color": "red"}'}}
    assistant = {"role": "assistant", "content": None, "tool_calls": [openai_call]}
    assert trajectory.messages_and_choices == [USER, assistant, tool]
    assert trajectory.tools == [{"type": "function", "function": {
        "name": "pick", "description": "Pick a color.", "parameters": tool_defs[0]["parameters"], "strict": True}}]
    back = rollout_output_from_trajectory(trajectory)
    assert back["tool_defs"] == tool_defs


def test_captured_calls_are_matched_by_completion_id_not_order():
    # Two rollouts of one group: same prompt, same reply text, different sampled ids.
    reply = {"role": "assistant", "content": "Red."}
    first, second = make_choice("Red.", [11, 12]), make_choice("Red.", [21, 22, 23])
    calls = [exchange([USER], second, "chatcmpl-b"), exchange([USER], first, "chatcmpl-a"),
             exchange([{"role": "user", "content": "judge this"}], make_choice("1", [5]), "chatcmpl-judge")]
    outputs = [{"prompt": [USER], "completion": [reply], "reward": r,
                "trajectory": [{"prompt": [USER], "completion": [reply], "response": {"id": cid}}]}
               for r, cid in ((1.0, "chatcmpl-a"), (0.0, "chatcmpl-b"))]
    group = trajectory_group_from_verifiers_outputs(outputs, exchanges=calls)
    assert [t.reward for t in group] == [1.0, 0.0]
    assert [choices_of(t)[0].token_ids for t in group] == [[11, 12], [21, 22, 23]]
    assert all(t.logs == [] for t in group)
    # A server that repeats ids: matched on request and reply instead, each call used once.
    for call in calls:
        object.__setattr__(call.response, "id", "same")
    group = trajectory_group_from_verifiers_outputs(outputs, exchanges=calls)
    assert sorted(choices_of(t)[0].token_ids for t in group) == [[11, 12], [21, 22, 23]]
    # No steps at all: the transcript's assistant turns still find their calls.
    lone = trajectory_from_verifiers_rollout({"prompt": [USER], "completion": [reply]}, exchanges=calls[1:2])
    assert lone.messages_and_choices[1].token_ids == [11, 12] and trained_tokens(lone) == 2


def test_step_tokens_give_exact_ids_without_a_capture():
    # What verifiers records when the server returns token ids (vLLM's return_token_ids).
    tokens = {"prompt_ids": [1, 5, 9], "prompt_mask": [0, 0, 0], "completion_ids": [40, 41, 2],
              "completion_mask": [1, 1, 1], "completion_logprobs": [-0.1, -0.2, -0.3], "is_truncated": False}
    reply = {"role": "assistant", "content": "Red."}
    output = {"prompt": [USER], "completion": [reply], "reward": 1.0,
              "trajectory": [{"prompt": [USER], "completion": [reply], "tokens": tokens}]}
    trajectory = trajectory_from_verifiers_rollout(output)
    [choice] = choices_of(trajectory)
    assert (choice.token_ids, choice.prompt_token_ids) == ([40, 41, 2], [1, 5, 9])
    assert [e.logprob for e in choice.logprobs.content] == [-0.1, -0.2, -0.3]
    assert choice.message.content == "Red." and trained_tokens(trajectory) == 3
    # Partly masked out (past verifiers' max_seq_len): not all of it was meant to train.
    output["trajectory"][0]["tokens"] = {**tokens, "completion_mask": [1, 1, 0]}
    assert choices_of(trajectory_from_verifiers_rollout(output)) == []


def test_round_trip_keeps_choices_ids_and_fields():
    tool_call = {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": '{"color": "red"}'}}
    c1 = make_choice(None, [7, 8, 9], prompt_ids=[1, 2], tool_calls=[tool_call])
    result = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    c2 = make_choice("Red.", [10, 2], prompt_ids=[1, 2, 7, 8, 9, 4, 5])
    side = art.History(messages_and_choices=[{"role": "user", "content": "Sub-task."}, make_choice("x", [3])])
    tools = [{"type": "function", "function": {"name": "pick", "description": "", "parameters": {"type": "object"}}}]
    original = art.Trajectory(messages_and_choices=[SYSTEM, USER, c1, result, c2], tools=tools, reward=0.5,
                              metrics={"correct": 1.0}, metadata={"scenario": "s1"}, logs=["seen"],
                              additional_histories=[side]).finish()
    output = rollout_output_from_trajectory(original, example_id=3)
    assert output["prompt"] == [SYSTEM, USER] and output["completion"][1] == result
    assert [s["tokens"]["completion_ids"] for s in output["trajectory"]] == [[7, 8, 9], [10, 2], [3]]
    json.dumps(output)  # what verifiers saves must be JSON

    again = trajectory_from_verifiers_rollout(json.loads(json.dumps(output)))
    assert [i.model_dump() if isinstance(i, Choice) else i for i in again.messages_and_choices] == \
           [i.model_dump() if isinstance(i, Choice) else i for i in original.messages_and_choices]
    [again_side] = again.additional_histories
    assert again_side.messages_and_choices[1].model_dump() == side.messages_and_choices[1].model_dump()
    assert (again.reward, again.metrics, again.tools) == (0.5, {"correct": 1.0}, tools)
    assert again.metadata["scenario"] == "s1" and again.metadata["verifiers_example_id"] == 3
    assert trained_tokens(again) == trained_tokens(original) == 6

    # Normalizing a verifiers output keeps its own fields; a trajectory without Choices is one step.
    plain = {"example_id": 4, "prompt": [USER], "completion": [{"role": "assistant", "content": "Red."}],
             "reward": 1.0, "answer": "red", "stop_condition": "no_tools_called", "timing": {"total": 1.5},
             "is_completed": False, "metrics": {}}
    [normalized] = normalize_verifiers_rollout_outputs([plain])
    assert normalized == normalize_verifiers_rollout_output(plain)
    assert {k: normalized[k] for k in ("example_id", "answer", "stop_condition", "timing", "is_completed")} == \
           {"example_id": 4, "answer": "red", "stop_condition": "no_tools_called", "timing": {"total": 1.5},
            "is_completed": False}
    [step] = normalized["trajectory"]
    assert (step["prompt"], step["completion"], step["tokens"]) == ([USER], plain["completion"], None)
    group = art.TrajectoryGroup([original, again])
    assert [o["example_id"] for o in rollout_outputs_from_trajectory_group(group, first_example_id=10)] == [10, 11]
    with pytest.raises(ValueError, match="prompt_length"):
        rollout_output_from_trajectory(original, prompt_length=9)


# -- environments against a served tiny model ----------------------------------------------


@pytest.fixture(scope="module")
def vf():
    pytest.importorskip("datasets")
    pytest.importorskip("verifiers.clients.openai_chat_completions_client",
                        reason="verifiers' classic Environment API (verifiers < 0.4)")
    import verifiers

    return verifiers


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(vf, tiny_model_path, tmp_path_factory):
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("verifiers")))
    model = art.TrainableModel(name="tiny-vf", project="verifiers", base_model=str(tiny_model_path))
    await model.register(backend)
    yield model, backend
    await backend.close()


def dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


def text_reward(completion) -> float:
    """Longer replies score higher: a different reward per rollout, from its own text."""
    return min(len(completion[-1].content or ""), 50) / 50


def first_token(state) -> float:
    """The first id verifiers recorded for this rollout (a metric, weight 0)."""
    return float(state["trajectory"][0]["tokens"]["completion_ids"][0])


def sampled_tokens(state) -> float:
    return float(sum(len(step["tokens"]["completion_ids"]) for step in state["trajectory"]))


def single_turn_env(vf):
    rubric = vf.Rubric(funcs=[text_reward])
    rubric.add_metric(first_token)
    rubric.add_metric(sampled_tokens)
    return vf.SingleTurnEnv(dataset=dataset([{"question": "Name a color.", "answer": "red"}]),
                            system_prompt="Be brief.", rubric=rubric)


@pytest.mark.integration
async def test_single_turn_group_keeps_each_rollouts_own_choice(vf, served):
    model, _ = served
    env = single_turn_env(vf)
    row = env.get_dataset().to_list()[0]
    group = await trajectory_group_with_verifiers_environment(env, model, [row] * 4, sampling_args={"max_tokens": 6})

    assert len(group.trajectories) == 4 and not group.exceptions
    for trajectory in group:
        system, user, choice = trajectory.messages_and_choices
        assert system == {"role": "system", "content": "Be brief."}
        assert user == {"role": "user", "content": "Name a color."}
        assert isinstance(choice, Choice) and choice.step == 0
        assert len(choice.logprobs.content) == len(choice.token_ids) >= 1 and choice.prompt_token_ids
        # The rubric scored this very Choice, and verifiers recorded these very ids for this rollout.
        assert trajectory.reward == pytest.approx(min(len(choice.message.content), 50) / 50)
        assert trajectory.metrics["first_token"] == choice.token_ids[0]
        assert trajectory.metrics["sampled_tokens"] == len(choice.token_ids) == trained_tokens(trajectory)
        assert trajectory.metadata["verifiers_answer"] == "red" and trajectory.logs == []
    assert len({tuple(c.token_ids) for t in group for c in choices_of(t)}) == 4


@pytest.fixture(scope="module")
def retry_env(vf):
    """A MultiTurnEnv subclass as verifiers users write one: the environment answers each turn."""

    class RetryEnv(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [vf.UserMessage(content=f"Try {len(state['trajectory']) + 1}: another color.")]

    rubric = vf.Rubric(funcs=[text_reward])
    rubric.add_metric(sampled_tokens)
    return RetryEnv(dataset=dataset([{"question": "Name a color.", "answer": "red"}]), rubric=rubric, max_turns=3)


@pytest.mark.integration
async def test_multi_turn_group_turns_are_the_calls_verifiers_recorded(vf, served, retry_env):
    model, _ = served
    row = retry_env.get_dataset().to_list()[0]
    from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

    client = OpenAIChatCompletionsClient(model.openai_client())
    # Sampling args as prime-rl sends them to vLLM: our server takes them.
    sampling = {"max_tokens": 5, "temperature": 1.0, "logprobs": True,
                "extra_body": {"return_token_ids": True, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                               "skip_special_tokens": False}}
    with art.AutoTrajectoryContext() as captured:
        outputs = await retry_env.run_group(group_inputs=[row] * 3, client=client, model=model.get_inference_name(),
                                            sampling_args=sampling, state_columns=["trajectory"])
    calls = {e.response.id: e for e in captured.exchanges.chat_completions}
    group = trajectory_group_from_verifiers_outputs(outputs, exchanges=captured.exchanges.chat_completions)

    for output, trajectory in zip(outputs, group):
        items = trajectory.messages_and_choices
        assert [type(i).__name__ for i in items] == ["dict", "Choice", "dict", "Choice", "dict", "Choice"]
        assert [i["content"] for i in items[2::2]] == ["Try 2: another color.", "Try 3: another color."]
        for step, choice in zip(output["trajectory"], choices_of(trajectory)):
            assert choice.model_dump() == calls[step["response"].id].response.choices[0].model_dump()
            assert choice.token_ids == step["tokens"]["completion_ids"]
            assert choice.prompt_token_ids == step["tokens"]["prompt_ids"]
        assert trajectory.metrics["num_turns"] == 3
        assert trajectory.metrics["sampled_tokens"] == trained_tokens(trajectory)
        assert trajectory.reward == output["reward"]

    # The one-rollout runner: the same, through env.run_rollout.
    single = await rollout_with_verifiers_environment(retry_env, model, row, sampling_args={"max_tokens": 5})
    assert len(choices_of(single)) == 3 and single.metrics["sampled_tokens"] == trained_tokens(single)


def pick(color: Literal["red", "blue"]) -> str:
    """Pick a color.

    Args:
        color: The color to pick.
    """
    return f"you picked {color}"


def picked_red(completion) -> float:
    """1 per tool result that says red."""
    return float(sum(getattr(m, "content", "") == "you picked red" for m in completion if m.role == "tool"))


@pytest.mark.integration
async def test_tool_env_turns_call_the_python_tool(vf, served):
    model, _ = served
    env = vf.ToolEnv(dataset=dataset([{"question": "Pick a color.", "answer": "red"}]), tools=[pick],
                     rubric=vf.Rubric(funcs=[picked_red]), max_turns=2)
    row = env.get_dataset().to_list()[0]
    trajectory = await rollout_with_verifiers_environment(
        env, model, row, sampling_args={"max_tokens": 40, "tool_choice": "required"})

    [tool] = trajectory.tools
    assert tool["function"]["name"] == "pick"
    assert tool["function"]["parameters"]["properties"]["color"]["enum"] == ["red", "blue"]
    user, first, result, second = trajectory.messages_and_choices
    assert user == {"role": "user", "content": "Pick a color."}
    assert isinstance(first, Choice) and first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    color = json.loads(call.function.arguments)["color"]
    assert result == {"role": "tool", "tool_call_id": call.id, "content": f"you picked {color}"}
    assert isinstance(second, Choice) and second.message.tool_calls  # max_turns stops before its tool runs
    assert trajectory.reward == (color == "red")
    assert trajectory.metrics["pick_calls"] == 2
    assert trajectory.metadata["verifiers_stop_condition"] == "max_turns_reached"
    assert trained_tokens(trajectory) == sum(len(c.token_ids) for c in choices_of(trajectory))


@pytest.mark.integration
async def test_two_training_steps_from_verifiers_groups(vf, served):
    _, backend = served
    model = art.TrainableModel(name="tiny-vf-train", project="verifiers", base_model=served[0].base_model)
    await model.register(backend)
    env = single_turn_env(vf)
    row = env.get_dataset().to_list()[0]
    for step in (0, 1):
        group = await trajectory_group_with_verifiers_environment(env, model, [row] * 4,
                                                                  sampling_args={"max_tokens": 6})
        assert len({t.reward for t in group}) > 1  # something to learn from
        assert {c.step for t in group for c in choices_of(t)} == {step}  # sampled by the latest weights
        # Every sampled token of every member with an advantage trains (one at the mean has none).
        advantages = group_advantages([t.reward for t in group])
        sampled = sum(len(c.token_ids) for t, a in zip(group, advantages) if a != 0 for c in choices_of(t))
        result = await backend.train(model, [group], learning_rate=1e-3)
        assert result.step == step + 1
        assert result.metrics["trained_tokens"] == sampled > 0
        assert not [k for k in result.metrics if k.startswith("skipped/")], result.metrics
