"""The import paths ART's own examples, dev scripts and docs use resolve here, to the real thing.

IMPORTS lists each `from art.X import Y` found in ART's `examples/`, `dev/` and docs that names
something this library has (cloud backends and other services it has not are listed in
docs/art-compatibility.md instead). Each must import, and each name must be our own class,
function or constant. The tests after it check that the helpers behave as ART's do, on
a run logged to disk by `Model.log`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from pathlib import Path

import pytest
from openai.types.chat.chat_completion import Choice

import art

IMPORTS: list[tuple[str, tuple[str, ...]]] = [
    ("art.local", ("LocalBackend",)),
    ("art.local.backend", ("LocalBackend",)),
    ("art.backend", ("Backend",)),
    ("art.utils.litellm", ("convert_litellm_choice_to_openai",)),
    ("art.mcp", ("generate_scenarios",)),
    ("art.mcp.types", ("MCPTool", "MCPResource", "GeneratedScenario", "GeneratedScenarioCollection")),
    ("art.mcp.generate_scenarios", ("generate_scenarios",)),
    ("art.langgraph", ("init_chat_model", "wrap_rollout")),
    ("art.verifiers", ("rollout_with_verifiers_environment", "trajectory_group_with_verifiers_environment",
                       "trajectory_from_verifiers_rollout")),
    ("art.types", ("TrainConfig", "TrainSFTConfig", "Messages", "MessagesAndChoices", "Tools")),
    ("art.trajectories", ("Trajectory", "TrajectoryGroup", "History", "LegacyHistory")),
    ("art.dev", ("InternalModelConfig", "EngineArgs", "InitArgs", "PeftArgs", "LoRAConfig", "TrainConfig")),
    ("art.utils", ("iterate_dataset", "limit_concurrency", "retry")),
    ("art.utils.sft", ("train_sft_from_file", "create_sft_dataset_iterator")),
    ("art.utils.get_trajectory_messages", ("get_trajectory_messages",)),
    ("art.utils.get_repo_root_path", ("get_repo_root_path",)),
    ("art.utils.output_dirs", ("get_default_art_path", "get_models_dir", "get_model_dir", "get_step_checkpoint_dir",
                               "get_trajectories_dir", "get_trajectories_split_dir", "get_benchmarks_dir",
                               "get_output_dir_from_model_properties")),
    ("art.utils.benchmarking.load_trajectories", ("load_trajectories",)),
    ("art.utils.benchmarking.charts", ("training_progress_chart", "percentage_comparison_bar_chart")),
    ("art.utils.benchmarking.types", ("BenchmarkModelKey",)),
    ("art.rewards", ("ruler", "ruler_score_group")),
    ("art.rewards.ruler", ("Response", "TrajectoryScore", "DEFAULT_RUBRIC", "_is_ollama_model",
                           "_get_response_format_for_ollama")),
    ("art.pipeline_trainer", ("PipelineTrainer",)),
]


@pytest.mark.parametrize("module,names", IMPORTS, ids=[module for module, _ in IMPORTS])
def test_arts_import_path_resolves_to_our_own_object(module, names):
    imported = importlib.import_module(module)
    for name in names:
        value = getattr(imported, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__.startswith("art."), f"{module}.{name} is {value.__module__}'s"
            assert inspect.getsource(value).strip(), f"{module}.{name} has no body"
        else:
            assert value, f"{module}.{name} is empty"


def test_the_backend_paths_are_one_class():
    from art.local import LocalBackend as short
    from art.local.backend import LocalBackend as long

    assert short is long is art.LocalBackend
    from art.backend import Backend

    assert Backend is art.Backend is art.RemoteBackend


def test_a_litellm_choice_converts_with_its_calls_logprobs_and_ids():
    from art.utils.litellm import convert_litellm_choice_to_openai

    litellm_like = {  # what litellm's Choices dumps to, with our server's extra ids
        "index": 0, "finish_reason": None, "token_ids": [5, 6],
        "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": None, "top_logprobs": []}]},
    }
    choice = convert_litellm_choice_to_openai(litellm_like)
    assert isinstance(choice, Choice) and choice.finish_reason == "stop"
    assert choice.message.tool_calls[0].function.name == "add" and choice.logprobs.content[0].logprob == -0.5
    assert choice.model_extra["token_ids"] == [5, 6]
    assert art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, choice]).messages()[-1]["tool_calls"]
    with pytest.raises(art.ArtValueError, match="assistant"):
        convert_litellm_choice_to_openai({"message": {"role": "user", "content": "hi"}})


def test_legacy_history_is_an_additional_history():
    from art.trajectories import LegacyHistory

    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "a"}],
                                additional_histories=[LegacyHistory(messages_and_choices=[{"role": "user", "content": "b"}])])
    assert trajectory.additional_histories[0].messages() == [{"role": "user", "content": "b"}]


def test_init_args_is_an_internal_config_key():
    config = art.dev.InternalModelConfig(init_args=art.dev.InitArgs(max_seq_length=512))
    model = art.TrainableModel(name="a", project="p", base_model="b", _internal_config=config)
    from art.service.settings import parse_internal_config

    assert parse_internal_config(model._internal_config).engine.max_model_len == 512


def test_get_trajectory_messages_turns_choices_into_assistant_messages():
    from art.utils.get_trajectory_messages import get_trajectory_messages

    choice = Choice.model_validate({"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "checking", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]}})
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice,
                                                      {"role": "tool", "tool_call_id": "c1", "content": "r"}])
    messages = get_trajectory_messages(trajectory)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "checking" and messages[1]["tool_calls"][0]["function"]["name"] == "search"


def test_repo_root_is_the_git_folder_above_the_current_one(tmp_path, monkeypatch):
    from art.utils.get_repo_root_path import get_repo_root_path
    from art.utils.output_dirs import get_benchmarks_dir, get_default_art_path

    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "examples" / "2048").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "repo" / "examples" / "2048")
    assert get_repo_root_path() == str(tmp_path / "repo")
    assert get_default_art_path() == str(tmp_path / "repo" / ".art")
    assert get_benchmarks_dir("2048") == str(tmp_path / "repo" / ".art" / "2048" / "benchmarks")
    monkeypatch.chdir(tmp_path)  # no repository: the current folder
    assert get_repo_root_path() == str(tmp_path)


# -- a logged project: one trained model over three steps, one prompted baseline -------------


def _group(wins: list[float], step: int) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=[{"role": "user", "content": f"game {i}"}, _choice(f"move {i}")],
                        reward=w, metrics={"win": w}, metadata={"game": f"g{step}-{i}"}, logs=[f"log {i}"])
         for i, w in enumerate(wins)],
        metadata={"step_tag": f"s{step}"})


def _choice(text: str) -> Choice:
    return Choice.model_validate({"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}})


@pytest.fixture
def logged_project(tmp_path) -> Path:
    async def log() -> None:
        agent = art.Model(name="agent-001", project="2048", base_path=str(tmp_path))
        for step, wins in enumerate([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]):
            await agent.log([_group(wins, step), _group([0.0], step)], split="val", step=step)
        await agent.log([_group([1.0], 9)], split="train", step=0)  # another split: not in the val charts
        baseline = art.Model(name="gpt-4o", project="2048", base_path=str(tmp_path))
        await baseline.log([_group([0.5, 0.5], 0)], split="val", step=0)

    asyncio.run(log())
    return tmp_path


def test_output_dirs_are_where_the_run_is_written(logged_project):
    from art.storage.layout import ModelDir
    from art.utils.output_dirs import (
        get_model_dir,
        get_models_dir,
        get_step_checkpoint_dir,
        get_trajectories_split_dir,
    )

    model = art.Model(name="agent-001", project="2048")
    run = Path(get_model_dir(model, str(logged_project)))
    assert (run / "history.jsonl").is_file() and run.parent == Path(get_models_dir("2048", str(logged_project)))
    written = {p.name for p in Path(get_trajectories_split_dir(str(run), "val")).iterdir()}
    assert {"0000.jsonl", "0001.jsonl", "0002.jsonl"} <= written  # and ART's .parquet beside them
    assert written - {"0000.jsonl", "0001.jsonl", "0002.jsonl"} <= {"0000.parquet", "0001.parquet", "0002.parquet"}
    assert Path(get_step_checkpoint_dir(str(run), 7)) == ModelDir(logged_project, "2048", "agent-001").checkpoints / "0007"
    with pytest.raises(art.ArtValueError):
        get_models_dir("../elsewhere", str(logged_project))


def test_trajectory_rows_have_arts_columns(logged_project):
    from art.utils.benchmarking.load_trajectories import trajectory_rows

    rows = trajectory_rows("2048", art_path=str(logged_project))
    assert len(rows) == 3 * 3 + 1 + 2
    assert {r["model"] for r in rows} == {"agent-001", "gpt-4o"}
    first = next(r for r in rows if r["model"] == "agent-001" and r["split"] == "val" and r["step"] == 1)
    assert first["reward"] == 1.0 and first["metric_win"] == 1.0 and first["logs"] == ["log 0"]
    assert first["metadata_game"] == "g1-0"
    assert [(m["role"], m["content"], m["trainable"]) for m in first["messages"]] == [
        ("user", "game 0", False), ("assistant", "move 0", True)]  # the model's own Choice is trainable
    # Groups are numbered across files; rows of one group share it, rows of two groups do not.
    step1 = [r for r in rows if r["model"] == "agent-001" and r["split"] == "val" and r["step"] == 1]
    assert len({r["group_number"] for r in step1}) == 2
    assert all(set(r) == set(rows[0]) for r in rows)  # rectangular
    only = trajectory_rows("2048", models=["gpt-4o"], art_path=str(logged_project))
    assert [r["model"] for r in only] == ["gpt-4o", "gpt-4o"]


def test_load_trajectories_is_a_polars_frame_or_says_to_install_polars(logged_project):
    from art.utils.benchmarking.load_trajectories import load_trajectories

    try:
        import polars  # noqa: F401
    except ImportError:
        with pytest.raises(art.ArtError, match="pip install polars"):
            asyncio.run(load_trajectories("2048", art_path=str(logged_project)))
        return
    df = asyncio.run(load_trajectories("2048", art_path=str(logged_project)))
    assert df.height == 12 and {"model", "split", "step", "reward", "metric_win", "metadata_game"} <= set(df.columns)


def test_training_progress_chart_draws_trained_lines_and_flat_baselines(logged_project):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from art.utils.benchmarking.charts import training_progress_chart
    from art.utils.benchmarking.load_trajectories import trajectory_rows
    from art.utils.benchmarking.types import BenchmarkModelKey

    rows = trajectory_rows("2048", art_path=str(logged_project))
    fig = training_progress_chart(
        rows, "win", models=[BenchmarkModelKey("agent-001", "Agent"), BenchmarkModelKey("gpt-4o", "GPT-4o")],
        title="Win Rate over Time", y_label="Win Rate", perfect_score=1.0)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    # Per-step means of the val split only (each step: two games of the model + one lost game).
    assert list(lines["Agent"].get_ydata()) == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert list(lines["Agent"].get_xdata()) == [0, 1, 2]
    assert list(lines["GPT-4o"].get_ydata()) == [0.5, 0.5] and lines["GPT-4o"].get_linestyle() == "--"
    assert list(lines["GPT-4o"].get_xdata()) == [0, 2]  # across the trained steps
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["Agent", "GPT-4o"]
    assert ax.get_title() == "Win Rate over Time" and ax.get_xlabel() == "Step" and ax.get_ylabel() == "Win Rate"
    assert "Perfect score" in [t.get_text() for t in ax.texts]
    with pytest.raises(art.ArtValueError, match="metric_missing"):
        training_progress_chart(rows, "missing")


def test_percentage_bar_chart_stacks_the_gain_of_training(logged_project):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from art.utils.benchmarking.charts import percentage_comparison_bar_chart
    from art.utils.benchmarking.load_trajectories import trajectory_rows

    rows = trajectory_rows("2048", art_path=str(logged_project))
    fig = percentage_comparison_bar_chart(rows, "metric_win", models=["gpt-4o", "agent-001"])  # val split
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["gpt-4o", "agent-001"]  # the order asked for
    texts = [t.get_text() for t in ax.texts]
    assert "RL +67%" in texts and "67%" in texts and "50%" in texts  # 0% at step 0, 67% at step 2
    heights = sorted(round(p.get_height(), 3) for p in ax.patches)
    assert heights == [0.0, 50.0, 66.667]
