"""Trajectory logs read with ART's `art.utils.trajectory_logging` helpers.

JSON lines (ART's earlier layout and our run log's step files) always; Parquet in ART's layout
when pyarrow is installed (those tests skip without it): written by `write_trajectory_groups_parquet`
and by `model.log` beside each step's JSONL, read back whole, and ART's own older files read too.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest
from openai.types.chat.chat_completion import Choice

import art
from art.storage.layout import ModelDir
from art.storage.run_log import parquet_file, write_log
from art.utils.trajectory_logging import (
    deserialize_trajectory_groups,
    message_or_choice_to_dict,
    read_trajectory_groups_parquet,
    serialize_trajectory_groups,
    trajectory_to_dict,
    write_trajectory_groups_parquet,
)

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def sampled(text: str, token_ids: list[int], tool_calls: list | None = None) -> Choice:
    return Choice.model_validate({
        "index": 0, "finish_reason": "tool_calls" if tool_calls else "stop",
        "message": {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})},
        "logprobs": {"content": [{"token": f"t{i}", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                 for i in token_ids]},
        "token_ids": token_ids, "prompt_token_ids": [1, 2, 3]})


def groups() -> list[art.TrajectoryGroup]:
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    agent = art.Trajectory(
        messages_and_choices=[{"role": "system", "content": "Be brief. 你好"},
                              {"role": "user", "content": "Look it up."}, sampled(None, [7], [call]),
                              {"role": "tool", "tool_call_id": "c1", "content": "42"}, sampled("It is 42.", [8, 9])],
        tools=[TOOL], reward=0.75, metrics={"turns": 2}, metadata={"scenario": "s1"}, logs=["looked up"],
        additional_histories=[art.History(messages_and_choices=[
            {"role": "user", "content": [{"type": "text", "text": "Judge it."}]}, sampled("fine", [5])])],
    )
    plain = art.Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, sampled("Hello", [4])], reward=0.25)
    return [
        art.TrajectoryGroup([agent, plain], exceptions=[ValueError("third rollout failed")],
                            metadata={"scenario": "s1"}, metrics={"judge": 0.5}, logs=["group log"]),
        art.TrajectoryGroup(exceptions=[RuntimeError("every rollout failed")]),
    ]


def dumped(items: list[art.TrajectoryGroup]) -> list[dict]:
    return [group.for_logging() for group in items]


# -- JSON lines -------------------------------------------------------------------------------


def test_json_lines_round_trip_for_reading():
    original = groups()
    text = serialize_trajectory_groups(original)
    assert len(text.splitlines()) == 2 and json.loads(text.splitlines()[0])["trajectories"][0]["reward"] == 0.75

    first, second = deserialize_trajectory_groups(text)
    agent = first.trajectories[0]
    assert (agent.reward, agent.metrics, agent.metadata, agent.logs, agent.tools) == (0.75, {"turns": 2},
                                                                                      {"scenario": "s1"},
                                                                                      ["looked up"], [TOOL])
    # Choices come back as Choices with their token ids, without the logprobs ART's logs leave out.
    choice = agent.messages_and_choices[2]
    assert isinstance(choice, Choice) and choice.logprobs is None and choice.token_ids == [7]
    assert choice.message.tool_calls[0].function.name == "lookup"
    assert agent.messages_and_choices[3] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert agent.additional_histories[0].messages_and_choices[1].message.content == "fine"
    assert (first.metadata, first.metrics, first.logs) == ({"scenario": "s1"}, {"judge": 0.5}, ["group log"])
    assert [e.message for e in first.exceptions] == ["third rollout failed"]
    assert second.trajectories == [] and [e.message for e in second.exceptions] == ["every rollout failed"]


def test_art_written_json_lines_and_dict_helpers():
    # A line as ART writes it: only "trajectories"; a choice dumped without logprobs.
    line = {"trajectories": [{"reward": 1.0, "metrics": {}, "metadata": {}, "logs": [],
                              "messages_and_choices": [{"role": "user", "content": "Hi"},
                                                       {"finish_reason": "stop", "index": 0,
                                                        "message": {"role": "assistant", "content": "Yo"}}]}]}
    [group] = deserialize_trajectory_groups(json.dumps(line) + "\n\n")
    assert group.trajectories[0].messages_and_choices[1].message.content == "Yo" and group.exceptions == []

    choice = sampled("ok", [3])
    assert message_or_choice_to_dict(choice) == {"finish_reason": "stop", "index": 0, "token_ids": [3],
                                                 "prompt_token_ids": [1, 2, 3],
                                                 "message": {"content": "ok", "role": "assistant"}}
    message = {"role": "assistant", "content": "x", "logprobs": [-1.0]}
    assert message_or_choice_to_dict(message) == {"role": "assistant", "content": "x"} and "logprobs" in message
    assert trajectory_to_dict(art.Trajectory(reward=2.0))["additional_histories"] == []


def test_yaml_logs_of_older_art_versions():
    yaml = pytest.importorskip("yaml")
    text = yaml.safe_dump([{"trajectories": [{"reward": 0.5, "metrics": {}, "metadata": {}, "logs": [],
                                              "messages_and_choices": [{"role": "user", "content": "Hi"}]}]}])
    [group] = deserialize_trajectory_groups(text)
    assert group.trajectories[0].reward == 0.5


def test_run_log_step_files_read_with_arts_helper(tmp_path):
    """Our step file (one trajectory per line, with its group) reads as the groups logged."""
    directory = ModelDir(tmp_path, "proj", "run")
    original = groups()
    write_log(directory, split="val", step=3, metrics={}, groups=original)
    read = deserialize_trajectory_groups(directory.trajectories("val", 3).read_text())
    assert [[t.reward for t in g] for g in read] == [[0.75, 0.25]]  # the empty group has no line
    # Whole trajectories: choices keep their token ids and logprobs there.
    assert [t.model_dump(mode="json") for t in read[0]] == [t.model_dump(mode="json") for t in original[0]]


def test_without_pyarrow_the_run_log_keeps_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as on a client installed without it
    directory = ModelDir(tmp_path, "proj", "run")
    write_log(directory, split="train", step=1, metrics={}, groups=groups())
    assert directory.trajectories("train", 1).exists() and not parquet_file(directory, "train", 1).exists()
    with pytest.raises(ModuleNotFoundError, match="pip install pyarrow"):
        write_trajectory_groups_parquet(groups(), tmp_path / "x.parquet")


# -- Parquet ----------------------------------------------------------------------------------


@pytest.fixture
def pq():
    return pytest.importorskip("pyarrow.parquet")


def test_parquet_round_trip_is_whole(tmp_path, pq):
    path = tmp_path / "groups.parquet"
    original = groups()
    write_trajectory_groups_parquet(original, path)
    read = read_trajectory_groups_parquet(path)
    assert dumped(read) == dumped(original)  # token ids, logprobs, tools, histories, exceptions, timestamps

    schema = pq.read_schema(path)
    assert schema.metadata == {b"art.trajectory_parquet.version": b"2"}
    rows = pq.read_table(path).to_pylist()
    assert [(r["group_index"], r["trajectory_index"]) for r in rows] == [(0, 0), (0, 1), (1, None)]
    assert json.loads(rows[0]["group_metadata"]) == {"scenario": "s1"} and rows[0]["group_logs"] == ["group log"]
    assert json.loads(rows[0]["tools"]) == [TOOL] and rows[2]["trajectory_json"] is None
    # ART's flat columns: choices are the trainable messages.
    flat = rows[0]["messages"]
    assert [(m["role"], m["trainable"]) for m in flat] == [("system", False), ("user", False), ("assistant", True),
                                                           ("tool", False), ("assistant", True)]
    assert json.loads(flat[2]["tool_calls"])[0]["function"]["name"] == "lookup" and flat[3]["tool_call_id"] == "c1"

    write_trajectory_groups_parquet([], path)
    assert read_trajectory_groups_parquet(path) == []


def test_parquet_rows_in_any_order_and_damaged_files(tmp_path, pq):
    import pyarrow as pa

    path = tmp_path / "g.parquet"
    write_trajectory_groups_parquet([art.TrajectoryGroup([art.Trajectory(reward=r) for r in (1, 2, 3)]),
                                     art.TrajectoryGroup()], path)
    table = pq.read_table(path)
    pq.write_table(table.take(pa.array([3, 2, 0, 1])), path)
    assert [[t.reward for t in g] for g in read_trajectory_groups_parquet(path)] == [[1, 2, 3], []]

    def damaged(name: str, new_table) -> str:
        pq.write_table(new_table, tmp_path / name)
        return str(tmp_path / name)

    future = damaged("future.parquet", table.replace_schema_metadata({b"art.trajectory_parquet.version": b"3"}))
    with pytest.raises(ValueError, match="Unsupported trajectory Parquet version: 3"):
        read_trajectory_groups_parquet(future)
    column = table.schema.get_field_index("trajectory_index")
    twice = damaged("twice.parquet", table.set_column(column, "trajectory_index",
                                                      pa.array([0, 0, 1, None], type=pa.int64())))
    with pytest.raises(ValueError, match="duplicate or missing trajectories"):
        read_trajectory_groups_parquet(twice)
    marker = table.schema.get_field_index("format_version")
    unmarked = damaged("unmarked.parquet", table.remove_column(marker).replace_schema_metadata(None))
    with pytest.raises(ValueError, match="missing its version marker"):
        read_trajectory_groups_parquet(unmarked)
    gap = damaged("gap.parquet", table.take(pa.array([3])))  # only group 1
    with pytest.raises(ValueError, match="group indexes are duplicate or non-contiguous"):
        read_trajectory_groups_parquet(gap)


@pytest.mark.parametrize("with_group_columns", [False, True])
def test_arts_older_parquet_files_read(tmp_path, pq, with_group_columns):
    """ART's version 1 files (flat columns, no version marker): choices are plain messages there."""
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
                         ("tool_call_id", pa.string()), ("trainable", pa.bool_())])
    fields = [("reward", pa.float64()), ("metrics", pa.string()), ("metadata", pa.string()), ("tools", pa.string()),
              ("logs", pa.list_(pa.string())), ("messages", pa.list_(message))]
    row = {"reward": 0.5, "metrics": '{"score": 1}', "metadata": '{"source": "v1"}', "tools": None, "logs": ["old"],
           "messages": [{"role": "user", "content": "Hi", "tool_calls": None, "tool_call_id": None, "trainable": False},
                        {"role": "assistant", "content": None, "tool_calls": '[{"id": "c", "type": "function", '
                         '"function": {"name": "f", "arguments": "{}"}}]', "tool_call_id": None, "trainable": True}]}
    if with_group_columns:
        fields = [("group_index", pa.int64()), ("group_metadata", pa.string()), ("group_logs", pa.list_(pa.string())),
                  *fields]
        row |= {"group_index": 0, "group_metadata": '{"fixture": "v1"}', "group_logs": ["old group"]}
    path = tmp_path / "v1.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=pa.schema(fields)), path)

    [group] = read_trajectory_groups_parquet(path)
    [trajectory] = group.trajectories
    assert (trajectory.reward, trajectory.metrics, trajectory.metadata, trajectory.logs) == (0.5, {"score": 1},
                                                                                            {"source": "v1"}, ["old"])
    assert trajectory.messages_and_choices[1]["tool_calls"][0]["function"]["name"] == "f"
    assert group.metadata == ({"fixture": "v1"} if with_group_columns else {})


async def test_each_logged_step_gets_arts_parquet(tmp_path, pq, caplog):
    model = art.Model(name="run", project="proj", base_path=str(tmp_path))
    directory = ModelDir(tmp_path, "proj", "run")
    original = groups()
    await model.log(original, split="val", step=0)
    await model.log([art.TrajectoryGroup([art.Trajectory(reward=5.0)])], split="val", step=0)  # the same step again

    read = read_trajectory_groups_parquet(parquet_file(directory, "val", 0))
    assert [[t.reward for t in g] for g in read] == [[0.75, 0.25], [], [5.0]]  # both calls, groups apart
    assert dumped(read[:2]) == dumped(original)
    lines = directory.trajectories("val", 0).read_text().splitlines()
    assert [json.loads(line)["reward"] for line in lines] == [0.75, 0.25, 5.0]  # the JSONL record is unchanged

    # The Parquet copy never fails a log: the JSONL is the record.
    parquet_file(directory, "val", 1).mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="art.storage.run_log"):
        await model.log(groups(), split="val", step=1)
    assert "could not write" in caplog.text and directory.trajectories("val", 1).exists()
