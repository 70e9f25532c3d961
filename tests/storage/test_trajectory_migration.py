"""`art.utils.trajectory_migration` (ART's JSONL -> Parquet migration) on real files: ART's old
step files, our own run folder, and what the migrated files read back as."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types.chat.chat_completion import Choice

import art
from art.storage.layout import ModelDir
from art.storage.step_files import read_step_rows
from art.utils.trajectory_logging import read_trajectory_groups_parquet, write_trajectory_groups_parquet
from art.utils.trajectory_migration import (
    MigrationResult,
    auto_migrate_on_register,
    message_or_choice_to_dict,
    migrate_all_models,
    migrate_jsonl_to_parquet,
    migrate_model_dir,
    migrate_trajectories_dir,
)

NESTED = {"scenario": {"id": 7, "tags": ["a", "b"]}, "attempts": [1, {"retry": True}], "note": None}


def art_group_line(rewards: list[float], metadata: dict | None = None) -> str:
    """One line of ART's old JSONL: a group, its choices dumped without logprobs."""
    trajectories = [{
        "reward": reward, "metrics": {"turns": 2}, "metadata": metadata or {}, "tools": None,
        "additional_histories": [], "logs": [f"log {i}"],
        "messages_and_choices": [
            {"role": "system", "content": "You are helpful. " * 40},
            {"role": "user", "content": "Search for pizza"},
            {"finish_reason": "tool_calls", "index": 0, "message": {
                "role": "assistant", "content": None,
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "search", "arguments": '{"q": "pizza"}'}}]}},
            {"role": "tool", "tool_call_id": "call_1", "content": "Pizza Hut"},
        ],
    } for i, reward in enumerate(rewards)]
    return json.dumps({"trajectories": trajectories})


def write_art_step(path: Path, *lines: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))  # as ART wrote it: no newline after the last group
    return path


def test_an_art_jsonl_step_becomes_version_2_parquet_with_nothing_lost(tmp_path):
    jsonl = write_art_step(tmp_path / "0003.jsonl", art_group_line([0.2, 0.9], NESTED), art_group_line([1.0]))
    result = migrate_jsonl_to_parquet(jsonl)

    assert (result.files_migrated, result.files_skipped, result.errors) == (1, 0, [])
    parquet = tmp_path / "0003.parquet"
    assert not jsonl.exists() and result.bytes_before > 0 and result.bytes_after == parquet.stat().st_size
    assert pq.read_schema(parquet).metadata == {b"art.trajectory_parquet.version": b"2"}
    first, second = read_trajectory_groups_parquet(parquet)
    assert [t.reward for t in first.trajectories] == [0.2, 0.9] and [t.reward for t in second.trajectories] == [1.0]
    trajectory = first.trajectories[0]
    assert trajectory.metadata == NESTED and trajectory.logs == ["log 0"] and trajectory.metrics == {"turns": 2}
    choice = trajectory.messages_and_choices[2]
    assert isinstance(choice, Choice) and choice.message.tool_calls[0].function.name == "search"
    assert trajectory.messages_and_choices[3] == {"role": "tool", "tool_call_id": "call_1", "content": "Pizza Hut"}


def test_keep_the_original_dry_run_and_what_is_not_a_trajectory_file(tmp_path):
    kept = write_art_step(tmp_path / "keep.jsonl", art_group_line([0.5]))
    migrate_jsonl_to_parquet(kept, delete_original=False)
    assert kept.exists() and (tmp_path / "keep.parquet").exists()

    dry = write_art_step(tmp_path / "dry.jsonl", art_group_line([0.5]))
    estimate = migrate_jsonl_to_parquet(dry, dry_run=True)
    assert estimate.files_migrated == 1 and estimate.bytes_before == dry.stat().st_size
    assert 0 < estimate.bytes_after < estimate.bytes_before and not (tmp_path / "dry.parquet").exists()

    text = tmp_path / "readme.txt"
    text.write_text("not trajectories")
    sidecar = tmp_path / "0001.exceptions.jsonl"
    sidecar.write_text('{"group": 0, "exceptions": []}\n')
    for path in (text, sidecar):
        skipped = migrate_jsonl_to_parquet(path)
        assert (skipped.files_migrated, skipped.files_skipped) == (0, 1) and path.exists()

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert migrate_jsonl_to_parquet(empty).files_migrated == 1
    assert read_trajectory_groups_parquet(tmp_path / "empty.parquet") == []


def test_a_bad_file_is_an_error_entry_and_an_old_parquet_survives(tmp_path):
    missing = migrate_jsonl_to_parquet(tmp_path / "nope.jsonl")
    assert missing.files_migrated == 0 and missing.errors == [f"File not found: {tmp_path / 'nope.jsonl'}"]

    bad = tmp_path / "0002.jsonl"
    bad.write_text("not valid json{{{")
    write_trajectory_groups_parquet([art.TrajectoryGroup([art.Trajectory(reward=0.25)])], tmp_path / "0002.parquet")
    result = migrate_jsonl_to_parquet(bad)
    assert result.files_migrated == 0 and len(result.errors) == 1 and "Error migrating" in result.errors[0]
    assert bad.exists()  # left as it was
    [group] = read_trajectory_groups_parquet(tmp_path / "0002.parquet")
    assert group.trajectories[0].reward == 0.25

    model_dir = tmp_path / "m"
    write_art_step(model_dir / "trajectories" / "train" / "0000.jsonl", "{broken")
    with pytest.warns(RuntimeWarning, match="Error migrating"):
        assert len(auto_migrate_on_register(model_dir).errors) == 1


def test_a_projects_models_migrate_once_and_results_add_up(tmp_path):
    models = tmp_path / "proj" / "models"
    for name, splits in (("a", {"train": 3, "val": 1}), ("b", {"train": 1})):
        for split, steps in splits.items():
            for step in range(steps):
                write_art_step(models / name / "trajectories" / split / f"{step:04d}.jsonl",
                               art_group_line([0.1 * step, 0.5]))
    (models / "c").mkdir()  # a model that never logged

    seen: list[str] = []
    result = migrate_all_models(tmp_path, "proj", progress_callback=seen.append)
    assert result.files_migrated == 5 and result.errors == []
    assert sorted(p.relative_to(models).as_posix() for p in models.rglob("*.parquet")) == [
        "a/trajectories/train/0000.parquet", "a/trajectories/train/0001.parquet", "a/trajectories/train/0002.parquet",
        "a/trajectories/val/0000.parquet", "b/trajectories/train/0000.parquet"]
    assert not list(models.rglob("*.jsonl")) and sum(s.endswith(".jsonl") for s in seen) == 5
    assert result.compression_ratio == result.bytes_before / result.bytes_after
    assert result.space_saved == result.bytes_before - result.bytes_after

    again = migrate_model_dir(models / "a")
    assert (again.files_migrated, again.errors) == (0, [])
    missing_models = tmp_path / "other" / "models"
    assert migrate_all_models(tmp_path, "other").errors == [f"Models directory not found: {missing_models}"]
    assert migrate_trajectories_dir(tmp_path / "none").errors == [f"Directory not found: {tmp_path / 'none'}"]
    total = MigrationResult(1, 2, 30, 10, ["x"]) + MigrationResult(3, 0, 10, 10, ["y"])
    assert (total.files_migrated, total.files_skipped, total.bytes_before, total.bytes_after, total.errors) == (
        4, 2, 40, 20, ["x", "y"])
    assert total.compression_ratio == 2.0 and MigrationResult().compression_ratio == 0.0


async def test_our_run_folder_migrates_with_its_failures_and_reads_back_the_same(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=[])
    groups = [art.TrajectoryGroup([art.Trajectory(reward=r, metadata=NESTED, messages_and_choices=[
        {"role": "user", "content": f"q{r}"}]) for r in (0.0, 1.0)]),
              art.TrajectoryGroup([], exceptions=[RuntimeError("the tool crashed")])]
    await model.log(groups, split="val", step=4)
    directory = ModelDir(tmp_path, "p", "m")
    before = read_step_rows(directory, "val", 4)
    sidecar = directory.trajectories("val", 4).with_name("0004.exceptions.jsonl")
    assert sidecar.exists() and before.source == directory.trajectories("val", 4)

    result = migrate_model_dir(directory.path)
    assert (result.files_migrated, result.errors) == (1, [])
    assert not directory.trajectories("val", 4).exists() and sidecar.exists()  # the sidecar is not a trajectory file
    after = read_step_rows(directory, "val", 4)
    assert after.source.suffix == ".parquet"
    assert [(r["group"], r["reward"], r["metadata"]) for r in after.rows] == [
        (r["group"], r["reward"], r["metadata"]) for r in before.rows]
    assert [(f["group"], [e["message"] for e in f["exceptions"]]) for f in after.failed] == [(1, ["the tool crashed"])]


def test_arts_older_flat_parquet_keeps_tools_and_additional_histories(tmp_path):
    """The unversioned layout ART's earlier migration wrote: flat columns only."""
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
                         ("tool_call_id", pa.string()), ("trainable", pa.bool_())])
    schema = pa.schema([("group_index", pa.int64()), ("reward", pa.float64()), ("metrics", pa.string()),
                        ("metadata", pa.string()), ("tools", pa.string()), ("loss_mask", pa.string()),
                        ("logs", pa.list_(pa.string())), ("additional_histories", pa.string()),
                        ("messages", pa.list_(message))])
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    histories = [{"messages_and_choices": [
        {"role": "user", "content": "alternate"},
        {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "other"}}], "tools": None}]
    row = {"group_index": 0, "reward": 0.75, "metrics": '{"score": 1}', "metadata": json.dumps(NESTED),
           "tools": json.dumps(tools), "loss_mask": '{"type": "assistant"}', "logs": ["legacy"],
           "additional_histories": json.dumps(histories),
           "messages": [{"role": "user", "content": "old", "tool_calls": None, "tool_call_id": None,
                         "trainable": False}]}
    path = tmp_path / "v1.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=schema), path)

    [group] = read_trajectory_groups_parquet(path)
    trajectory = group.trajectories[0]
    assert trajectory.metadata == NESTED and trajectory.tools == tools and trajectory.logs == ["legacy"]
    [history] = trajectory.additional_histories
    assert history.messages_and_choices[0] == {"role": "user", "content": "alternate"}
    assert isinstance(history.messages_and_choices[1], Choice)


def test_nested_metadata_round_trips_through_the_versioned_layout(tmp_path):
    group = art.TrajectoryGroup([art.Trajectory(reward=0.5, metadata=NESTED)], metadata={"batch": {"ids": [1, 2]}})
    write_trajectory_groups_parquet([group], tmp_path / "x.parquet")
    [back] = read_trajectory_groups_parquet(tmp_path / "x.parquet")
    assert back.trajectories[0].metadata == NESTED and back.metadata == {"batch": {"ids": [1, 2]}}
    flat = pq.read_table(tmp_path / "x.parquet").to_pylist()[0]
    assert json.loads(flat["metadata"]) == NESTED  # ART's query column holds the nested value too


def test_legacy_choice_serialisation_keeps_only_the_fields_that_were_set():
    choice = Choice(index=0, finish_reason="stop", message={"role": "assistant", "content": "ok"})
    assert message_or_choice_to_dict(choice) == {"finish_reason": "stop", "index": 0,
                                                 "message": {"content": "ok", "role": "assistant"}}
