"""Every fenced Python block of README.md and docs/*.md runs here, or says why it does not.

The line before each ```python fence is a marker: `<!-- test: NAME -->` (a test below runs the
block, fetching it by NAME) or `<!-- not run: REASON -->` (a GPU, a remote box, a paid API, a run
that takes minutes). A block with neither, or a NAME no test runs, fails
`test_every_python_block_runs_or_says_why_not`.

The blocks run as written, against the tiny random model (`tiny_model_path`) instead of the
default one. A block that continues the Quick start (it uses `model`, `rollout`, `scenarios`)
gets those names from the Quick start's own definitions and a served tiny model. Two knobs, both
named where they are used: `art.DEFAULT_MODEL` points at the tiny model, and the Quick start's
ten steps are cut to one (`QUICK_START_STEPS`).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import random
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
import pytest_asyncio
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

import art
from art.server.thread import ServerThread
from art.training.sequences import sequences_of_trajectory

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- (test|not run): *(.*?) *-->")
FENCE = re.compile(r" *```+ *(python|py|python3)\b")
RUN_HERE = {"quick-start", "anthropic-agent", "capture", "reward-hacking", "ruler", "structured-json",
            "structured-choice", "costs", "pipeline-parts", "pipeline-trainer", "scaling-replicas",
            "scaling-fsdp", "dynamic-sampling", "sft", "verifiers", "langgraph", "moe-targets"}
"""The names of the blocks the tests below run."""
QUICK_START_STEPS = ("range(await model.get_step(), 10)", "range(await model.get_step(), 1)")
"""The Quick start trains ten steps; here one (the text must still read as the first)."""


def blocks() -> list[tuple[str, int, str | None, str | None, str]]:
    """(page, line, "test" / "not run" / None, name or reason, code) of every ```python block."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if FENCE.match(lines[i]):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
                kind, label = (marker.group(1), marker.group(2)) if marker else (None, None)
                found.append((page.relative_to(ROOT).as_posix(), i + 1, kind, label,
                              "\n".join(lines[i + 1:end]) + "\n"))
                i = end
            i += 1
    return found


def code(name: str) -> str:
    """The block marked `<!-- test: name -->`; one marked so on several pages must read the same."""
    assert name in RUN_HERE, name
    texts = {text for _, _, kind, label, text in blocks() if kind == "test" and label == name}
    assert len(texts) == 1, f"{name}: {len(texts)} different blocks"
    return texts.pop()


async def run(source: str, namespace: dict, name: str) -> dict:
    """Run a block as a notebook cell would: top-level `await` allowed."""
    compiled = compile(source, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(compiled, namespace)
    if inspect.iscoroutine(result):
        await result
    return namespace


def quick_start_definitions() -> dict:
    """The Quick start's `scenarios`, `score` and `rollout`, without its `main`."""
    source = code("quick-start")
    namespace: dict = {}
    exec(compile(source[: source.index("async def main")], "quick-start", "exec"), namespace)
    return namespace


def test_every_python_block_runs_or_says_why_not():
    unmarked, unknown, bare = [], [], []
    for page, line, kind, label, _ in blocks():
        if kind is None:
            unmarked.append(f"{page}:{line}")
        elif kind == "test" and label not in RUN_HERE:
            unknown.append(f"{page}:{line} ({label})")
        elif kind == "not run" and len(label) < 10:
            bare.append(f"{page}:{line}")
    assert not unmarked, "blocks neither run nor marked <!-- not run: REASON -->: " + ", ".join(unmarked)
    assert not unknown, "blocks marked for a test that does not run them: " + ", ".join(unknown)
    assert not bare, "not-run blocks without a reason: " + ", ".join(bare)
    assert RUN_HERE == {label for _, _, kind, label, _ in blocks() if kind == "test"}


def test_a_block_with_no_marker_is_caught(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```python\nprint(1)\n```\n")
    monkeypatch.setattr(f"{__name__}.PAGES", [page])
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    with pytest.raises(AssertionError, match="page.md:3"):
        test_every_python_block_runs_or_says_why_not()


# -- the Quick start, run as a user runs it --------------------------------------------------


def as_the_block_runs(monkeypatch, tiny_model_path, tmp_path) -> list:
    """A block that names `art.DEFAULT_MODEL` and makes its own `art.LocalBackend()` runs in
    `tmp_path` on the tiny model; the list collects its backends, for the test to close."""
    backends: list = []

    class Recorded(art.LocalBackend):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            backends.append(self)

    monkeypatch.setattr(art, "DEFAULT_MODEL", str(tiny_model_path))
    monkeypatch.setattr(art, "LocalBackend", Recorded)
    monkeypatch.chdir(tmp_path)
    return backends


@pytest.mark.integration  # a served model
def test_the_quick_start_runs_as_written(tiny_model_path, tmp_path, monkeypatch):
    """README.md's and getting-started.md's Quick start (one text), one step on the tiny model."""
    source = code("quick-start")
    assert source.count(QUICK_START_STEPS[0]) == 1
    backends = as_the_block_runs(monkeypatch, tiny_model_path, tmp_path)
    try:
        exec(compile(source.replace(*QUICK_START_STEPS), "quick-start", "exec"), {"__name__": "__main__"})
    finally:
        for backend in backends:
            asyncio.run(backend.close())
    run_folder = tmp_path / ".art" / "my-agent" / "models" / "agent-001"
    assert (run_folder / "checkpoints" / "0001").is_dir()  # the step was trained and stored


# -- blocks that continue the Quick start, on one served tiny model ----------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(tiny_model_path, tmp_path_factory):
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("snippets")))
    model = art.TrainableModel(name="docs", project="snippets", base_model=str(tiny_model_path))
    await model.register(backend)
    yield model, backend
    await backend.close()


@pytest.mark.integration  # a served model
async def test_the_anthropic_agent_of_the_compatibility_page_records_and_trains(served):
    model, _ = served
    namespace = await run(code("anthropic-agent"), {}, "anthropic-agent")
    trajectories = [await namespace["rollout"](model, "Say yes.") for _ in range(2)]
    for trajectory in trajectories:
        [call] = trajectory.exchanges.messages
        sampled = call.response.model_extra["token_ids"]
        assert sampled and call.request["messages"][0]["content"] == "Say yes."
        [sequence] = sequences_of_trajectory(trajectory, Counter())
        assert sequence.token_ids[-len(sampled):] == sampled
    await train_one_step(model, trajectories)


async def train_one_step(model, trajectories) -> None:
    """Train on the trajectories with a signal, whatever the random model said."""
    step = await model.get_step()
    trajectories[0].reward, trajectories[1].reward = 1.0, 0.0
    await model.train([art.TrajectoryGroup(trajectories)], config=art.TrainConfig(learning_rate=1e-3))
    assert await model.get_step() == step + 1


@pytest.mark.integration  # a served model
async def test_the_captured_agent_records_the_sampled_choices_and_trains(served):
    model, _ = served
    namespace = await run(code("capture"), {}, "capture")
    group = await art.trajectory_group(namespace["rollout"](model, "Say yes.") for _ in range(2))
    for trajectory in group.trajectories:
        [chat] = trajectory.exchanges.chat_completions
        choice = trajectory.messages_and_choices[-1]
        assert choice.token_ids == chat.response.choices[0].model_extra["token_ids"]
        assert trajectory.reward in (0.0, 1.0)
    await train_one_step(model, list(group.trajectories))


def test_the_gameable_reward_and_its_guard():
    exec(compile(code("reward-hacking"), "reward-hacking", "exec"), {})  # the block asserts itself


def scripted_judge() -> FastAPI:
    """An OpenAI-compatible judge that gives the n trajectories of its schema scores 1/n .. n/n."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        n = body["response_format"]["json_schema"]["schema"]["properties"]["scores"]["minItems"]
        answer = {"scores": [{"trajectory_id": str(i), "explanation": "ok", "score": round(i / n, 2)}
                             for i in range(1, n + 1)]}
        return {"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": json.dumps(answer)}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}}

    return app


@pytest.mark.integration  # a served model
async def test_ruler_scores_the_quick_starts_groups(served, tmp_path, monkeypatch):
    """The block names OpenAI's o4-mini (a paid API); OPENAI_BASE_URL points the same call at a
    scripted judge on loopback."""
    model, _ = served
    monkeypatch.chdir(tmp_path)  # the judge's answers are cached under ./.art
    with ServerThread(scripted_judge()) as judge:
        monkeypatch.setenv("OPENAI_BASE_URL", judge.base_url + "/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "test")
        namespace = await run(code("ruler"), {"art": art, "model": model, **quick_start_definitions()}, "ruler")
    groups = namespace["groups"]
    assert len(groups) == 2
    for group in groups:
        assert sorted(t.reward for t in group.trajectories) == [round(i / 8, 2) for i in range(1, 9)]
        assert all("independent_reward" in t.metrics for t in group.trajectories)


class Answer(BaseModel):
    """A schema with no room for more keys, so the random model's JSON ends."""

    model_config = ConfigDict(extra="forbid")
    answer: Literal["yes", "no", "maybe"]


@pytest.mark.integration  # a served model
async def test_structured_outputs_parse(served):
    model, _ = served
    namespace = {"client": model.openai_client(), "model": model, "Answer": Answer,
                 "messages": [{"role": "user", "content": "Will it rain? Answer in JSON."}]}
    await run(code("structured-json"), namespace, "structured-json")
    assert Answer.model_validate_json(namespace["completion"].choices[0].message.content)
    await run(code("structured-choice"), namespace, "structured-choice")
    assert namespace["completion"].choices[0].message.content in ("yes", "no", "maybe")


@pytest.mark.integration  # a served model
async def test_costs_are_logged_on_the_train_row(served):
    model, backend = served
    step = await model.get_step()
    namespace = {"art": art, "model": model, **quick_start_definitions()}
    namespace["score"] = lambda text, scenario: random.random()  # a signal from the random model
    await run(code("costs"), namespace, "costs")
    assert await model.get_step() == step + 1
    rows = [row for row in await backend.get_history(model) if "costs/train" in row]
    assert rows and rows[-1]["costs/train"] > 0.002  # the judge's 0.002 and the priced completions


@pytest.mark.integration  # a served model
async def test_dynamic_sampling_gathers_groups_with_signal(served):
    model, _ = served
    quick = quick_start_definitions()
    quick["score"] = lambda text, scenario: random.random()  # the random model needs a signal
    namespace = {"art": art, "model": model, "rollout": quick["rollout"], "dataset": quick["scenarios"]}
    await run(code("dynamic-sampling"), namespace, "dynamic-sampling")
    assert namespace["groups"].stats.groups_kept == 4


@pytest.mark.integration  # a served model
async def test_the_pipeline_trains_its_scenarios(served):
    model, backend = served
    namespace = await run(code("pipeline-parts"), {}, "pipeline-parts")
    namespace["score"] = lambda text, scenario: random.random()  # the random model needs a signal
    step = await model.get_step()
    namespace.update(model=model, backend=backend)
    await run(code("pipeline-trainer"), namespace, "pipeline-trainer")
    assert await model.get_step() > step


def test_the_scaling_settings_are_accepted():
    namespace = {"art": art}
    exec(compile(code("scaling-replicas"), "scaling-replicas", "exec"), namespace)
    assert namespace["model"]._internal_config["engine_replicas"] == 2
    exec(compile(code("scaling-fsdp"), "scaling-fsdp", "exec"), namespace)
    assert namespace["_internal_config"]["fsdp"] is True


@pytest.mark.integration  # a served model
async def test_the_moe_targets_of_the_models_page_are_what_the_model_gets(tmp_path):
    """The block's lora_config on a tiny Qwen3-MoE (its base_model id swapped for the folder)."""
    from peft.tuners.lora.layer import ParamWrapper

    from tests.support import families

    namespace = {"art": art}
    exec(compile(code("moe-targets"), "moe-targets", "exec"), namespace)
    given = namespace["model"]
    path = families.save_tiny("qwen3_moe", tmp_path / "moe", families.tokenizer())
    model = art.TrainableModel(name=given.name, project=given.project, base_model=str(path),
                               _internal_config=given._internal_config)
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    try:
        await model.register(backend)
        peft_model = backend.service.loaded((given.project, given.name)).model
        wrapped = {m.parameter_name for m in peft_model.modules() if isinstance(m, ParamWrapper)}
        linear = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")} - {"experts"}
        assert wrapped == {"down_proj"} and linear == {"q_proj", "k_proj", "v_proj", "o_proj"}
        assert peft_model.peft_config["default"].r == 16
    finally:
        await backend.close()


@pytest.mark.integration  # a served model
async def test_sft_from_a_file_and_from_trajectories(tiny_model_path, tmp_path, monkeypatch):
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": str(2 * i)}]} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    trajectories = [art.Trajectory(messages_and_choices=row["messages"]) for row in rows[:4]]
    backends = as_the_block_runs(monkeypatch, tiny_model_path, tmp_path)
    try:
        namespace = await run(code("sft"), {"trajectories": trajectories}, "sft")
        assert await namespace["model"].get_step() == 2  # one checkpoint per call
    finally:
        for backend in backends:
            await backend.close()


# -- the integrations, with the names each block leaves to you --------------------------------


@pytest.mark.integration  # a served model
async def test_the_verifiers_environment_trains(served):
    from datasets import Dataset

    model, _ = served
    step = await model.get_step()
    namespace = {"model": model, "dataset": Dataset.from_list([{"question": "Name a color.", "answer": "red"}]),
                 "correct": lambda completion: min(len(completion[-1].content or ""), 50) / 50}  # graded
    await run(code("verifiers"), namespace, "verifiers")
    assert len(namespace["group"].trajectories) == 8 and await model.get_step() == step + 1


@pytest.mark.integration  # a served model
async def test_the_langgraph_agent_trains(served):
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    model, _ = served
    step = await model.get_step()
    namespace = {"model": model, "tools": [add], "scenarios": [SimpleNamespace(question="What is 2 + 3?")],
                 "score": lambda result, scenario: random.random()}  # the random model needs a signal
    await run(code("langgraph"), namespace, "langgraph")
    [group] = namespace["groups"]
    assert all(not isinstance(t.messages_and_choices[-1], dict) for t in group.trajectories)  # the sampled Choice
    assert await model.get_step() == step + 1

