"""Multi-turn tool use end to end: tool calls through the real server, tool results as context,
and training on exactly the sampled assistant tokens, on the tiny model (fast) and on the
default model with examples/tool_agent.py (slow).

The tiny random model never writes a tool call by itself; `tool_choice="required"` makes the
server's constrained decoding produce one, so the parsed-call path runs for real.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

import art
from art.training.sequences import sequences_of_trajectory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_agent.py"
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The stock of an item.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
                       "required": ["item"], "additionalProperties": False},
    },
}


def load_example():
    spec = importlib.util.spec_from_file_location("tool_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def two_tool_turns(model: art.Model, seed: int, marker: str) -> art.Trajectory:
    """Call the tool, read its result, call it again, then answer: three sampled turns."""
    client = model.openai_client()
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "How many apples and pears?"}],
                                tools=[LOOKUP], reward=0.0)
    for turn, choice_of_tool in enumerate(("required", "required", "none")):
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), tools=[LOOKUP],
            tool_choice=choice_of_tool, max_tokens=40 if choice_of_tool == "required" else 6, seed=seed + turn)
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        for call in choice.message.tool_calls or []:
            trajectory.messages_and_choices.append(
                {"role": "tool", "tool_call_id": call.id, "content": f"{marker}-{turn}"})
    trajectory.reward = float(seed % 2)
    return trajectory


def trained_ids(trajectory: art.Trajectory) -> tuple[list[list[int]], int]:
    """(the trained ids of each training sequence, in order; the sequences' total token count)."""
    sequences = sequences_of_trajectory(trajectory, Counter())
    return ([[t for t, trained in zip(s.token_ids, s.trained) if trained] for s in sequences],
            sum(len(s.token_ids) for s in sequences))


def check_mask(trajectory: art.Trajectory, tokenizer) -> None:
    """Trained: every sampled assistant token, once, in order. Not trained: the prompt and the
    tool results, which are in the context as <tool_response> blocks."""
    choices = [item for item in trajectory.messages_and_choices if not isinstance(item, dict)]
    per_sequence, _ = trained_ids(trajectory)
    assert [t for ids in per_sequence for t in ids] == [t for c in choices for t in c.token_ids]
    sequences = sequences_of_trajectory(trajectory, Counter())
    context = "".join(tokenizer.decode([t for t, trained in zip(s.token_ids, s.trained) if not trained])
                      for s in sequences)
    question = trajectory.messages_and_choices[0]["content"]
    assert question in context
    for message in trajectory.messages_and_choices:
        if isinstance(message, dict) and message["role"] == "tool":
            assert f"<tool_response>\n{message['content']}\n</tool_response>" in context


@pytest.mark.integration
async def test_two_tool_turns_through_the_server_train_only_the_assistant_tokens(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="agent", project="tools", base_model=str(tiny_model_path))
    await model.register(backend)
    try:
        group = await art.TrajectoryGroup(two_tool_turns(model, seed, marker=f"STOCK{seed}") for seed in (1, 2))
        for trajectory in group.trajectories:
            choices = [item for item in trajectory.messages_and_choices if not isinstance(item, dict)]
            assert len(choices) == 3
            for turn, choice in enumerate(choices[:2]):  # parsed calls, arguments that fit the schema
                assert choice.finish_reason == "tool_calls" and choice.message.content is None
                (call,) = choice.message.tool_calls
                assert call.function.name == "lookup" and json.loads(call.function.arguments)["item"].isalpha()
            marker = trajectory.messages_and_choices[2]["content"]
            # the tool's result is context of the next turn, as a <tool_response> block
            assert f"<tool_response>\n{marker}\n</tool_response>" in tokenizer.decode(choices[1].prompt_token_ids)
            assert choices[2].message.tool_calls is None  # tool_choice="none": text only
            check_mask(trajectory, tokenizer)
        await model.train([group], config=art.TrainConfig(learning_rate=1e-3))

        logged = tmp_path / "tools" / "models" / "agent" / "trajectories" / "train" / "0000.jsonl"
        for line, original in zip(logged.read_text().splitlines(), group.trajectories):
            reloaded = art.Trajectory.from_logging(json.loads(line))
            assert trained_ids(reloaded) == trained_ids(original)  # the same mask from disk
        history = [json.loads(line) for line in (logged.parents[2] / "history.jsonl").read_text().splitlines()]
        train_row = next(row for row in history if "train/loss" in row)
        assert train_row["train/trained_tokens"] == sum(
            len(c.token_ids) for t in group.trajectories for c in t.messages_and_choices if not isinstance(c, dict))
        assert not any(key.startswith("train/skipped/choice") for key in train_row)
        assert train_row["train/rollouts"] == 2 and train_row["train/rollouts_per_trained_group"] == 2
    finally:
        await backend.close()


@pytest.mark.integration
async def test_the_examples_episodes_train_every_assistant_turn_and_nothing_else(tiny_model_path, tmp_path):
    """examples/tool_agent.py's own rollout, on the tiny model: a forced `calculate` call, the
    tool's result, a free answer; the trajectory keeps the Choices and the tool messages."""
    from transformers import AutoTokenizer

    example = load_example()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="calc", project="tools", base_model=str(tiny_model_path))
    await model.register(backend)
    try:
        trajectories = await art.gather_trajectories((example.rollout(model, 12, 34, seed=s) for s in range(3)),
                                                     pbar_desc=None)
    finally:
        await backend.close()
    for trajectory in trajectories:
        items = trajectory.messages_and_choices
        assert isinstance(items[0], dict) and not isinstance(items[1], dict)  # the question, the first turn
        assert items[1].message.tool_calls[0].function.name == "calculate"
        tool = items[2]
        assert tool["role"] == "tool" and tool["tool_call_id"] == items[1].message.tool_calls[0].id
        assert tool["content"] == example.calculate(items[1].message.tool_calls[0].function.arguments)
        assert trajectory.metrics["turns"] >= 2 and trajectory.metrics["tool_calls"] >= 1
        check_mask(trajectory, tokenizer)


def test_the_examples_reward_and_tool():
    example = load_example()
    assert example.calculate('{"expression": "12 * 34"}') == "408"
    assert example.calculate('{"expression": "12 + 34"}').startswith("error")
    assert example.calculate("not json").startswith("error")
    # A turn with tool_choice="auto" is not constrained: the server checks only that the
    # arguments are a JSON object, so the tool answers any other value with an error, never raises.
    for arguments in ('{"expression": 12}', '{"expression": null}', '{"expression": ["1*2"]}', '[1]', '{}'):
        assert example.calculate(arguments).startswith("error"), arguments
    assert example.first_number("The answer is 408.") == "408" and example.first_number("none") is None


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.extended  # 142 s in CI; with the pipeline test (also extended), benchmarks/pipeline_vs_sync.py covers it
async def test_the_tool_agent_learns_on_the_default_model(tmp_path):
    """Fixed seed, 3 measured steps and 2 updates (about 3 minutes). The forced call's
    arguments are learnt first: valid calls 0.56 -> 0.84 -> 0.97 and mean reward 0.11 -> 0.22
    -> 0.37 under CISPO (0.11 -> 0.19 -> 0.32 under PPO), measured locally; the success rate
    follows more slowly and with more spread between runs (0.00 -> 0.06 -> 0.22 for this seed;
    0.16 -> 0.06 -> 0.50 for seed 1 under PPO), so it is only required to rise."""
    example = load_example()
    rows = await example.main(steps=3, seed=0, path=str(tmp_path), quiet=True, train_last=False)
    assert len(rows) == 3
    trend = {key: [round(r[key], 2) for r in rows] for key in ("valid_tool_call", "reward", "success")}
    assert rows[-1]["valid_tool_call"] >= rows[0]["valid_tool_call"] + 0.25, trend
    assert rows[-1]["reward"] >= rows[0]["reward"] + 0.1, trend
    assert max(r["success"] for r in rows[1:]) > rows[0]["success"], trend
    assert (tmp_path / "tool-agent" / "models" / "calculator-seed0" / "tool_agent.png").stat().st_size > 1000
