"""RULER: the judge prompt, strict answers, retries, the cache, and our own server as the judge.

A judge whose answers a test must choose (malformed, a repeated id, a score of 1.7) is a small
scripted OpenAI-compatible server on loopback: such a judge exists in the wild (a local model
without structured output) but cannot be summoned here on demand. Everything else runs for
real: the `openai` client, our server with constrained decoding, a LocalBackend training.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai.types.chat.chat_completion import Choice

import art
from art.errors import JudgeError
from art.rewards import RulerStats, ruler, ruler_score_group
from art.rewards.judge_answer import answer_schema, parse_answer
from art.rewards.judge_prompt import judge_messages
from art.rewards.ruler import Response, _get_response_format_for_ollama, _is_ollama_model
from art.server.thread import ServerThread

SYSTEM = {"role": "system", "content": "You answer with one word: yes, no or maybe. SYSTEM-MARKER"}
ASK = {"role": "user", "content": "Is it going to rain tomorrow?"}


def choice(text: str, token_ids: list[int]) -> Choice:
    """An assistant Choice as our server returns it: with token ids and logprobs."""
    return Choice.model_validate({"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text},
            "logprobs": {"content": [{"token": f"t{t}", "logprob": -0.123456, "bytes": None, "top_logprobs": []}
                                     for t in token_ids]},
            "token_ids": token_ids})


def group(*texts: str, rewards=None) -> art.TrajectoryGroup:
    rewards = rewards or [0.0] * len(texts)
    return art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=[SYSTEM, ASK, choice(text, [9001 + i, 9002 + i])], reward=r, logs=["kept"])
        for i, (text, r) in enumerate(zip(texts, rewards)))


def answer(*scores: float, ids=None) -> str:
    ids = ids or [str(i) for i in range(1, len(scores) + 1)]
    return json.dumps({"scores": [{"trajectory_id": i, "explanation": f"reason {i}", "score": s}
                                  for i, s in zip(ids, scores)]})


class ScriptedJudge:
    """An OpenAI-compatible chat endpoint that answers from a queue and records each request.
    A queued int is an HTTP error status; `refuse_schemas` answers 400 to json_schema requests."""

    def __init__(self, refuse_schemas: bool = False) -> None:
        self.answers: list = []
        self.requests: list[dict] = []
        self.keys: list[str] = []
        """The API key of each request (its Authorization header)."""
        self.refuse_schemas = refuse_schemas
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            self.keys.append(request.headers.get("authorization", "").removeprefix("Bearer "))
            if self.refuse_schemas and (body.get("response_format") or {}).get("type") == "json_schema":
                return JSONResponse({"error": {"message": "response_format json_schema is not supported",
                                               "type": "invalid_request_error", "param": "response_format"}}, 400)
            reply = self.answers.pop(0)
            if isinstance(reply, int):
                return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, reply)
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": reply}}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}

        self.app = app


@pytest.fixture
def judge():
    scripted = ScriptedJudge()
    with ServerThread(scripted.app) as server:
        scripted.client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        yield scripted


# -- the prompt ---------------------------------------------------------------------------


def test_prompt_shows_the_shared_prefix_once_and_no_token_data():
    g = group("yes", "maybe, probably", "no")
    messages = judge_messages([t.messages() for t in g.trajectories], "- rubric line", 2048)
    user = messages[1]["content"]
    assert user.count("SYSTEM-MARKER") == 1 and user.count("Is it going to rain") == 1
    assert user.index("SYSTEM-MARKER") < user.index('<trajectory id="1">')
    for text in ("yes", "maybe, probably", "no"):
        assert f"[assistant] {text}" in user
    for leak in ("logprob", "-0.123456", "9001", "token_ids"):
        assert leak not in json.dumps(messages)
    assert "- rubric line" in messages[0]["content"]


def test_prompt_renders_tool_calls_and_truncates_long_trajectories():
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "rain"}'}}]}
    tool = {"role": "tool", "tool_call_id": "c1", "name": "search", "content": "90% chance"}
    long = {"role": "assistant", "content": "start " + "blah " * 2000 + "FINAL ANSWER"}
    messages = judge_messages([[ASK, call, tool], [ASK, long]], "r", max_trajectory_tokens=100)
    user = messages[1]["content"]
    assert 'search({"q": "rain"})' in user and "[tool search] 90% chance" in user
    assert "characters cut to fit the judge's budget" in user and "FINAL ANSWER" in user and "start" in user
    assert len(user) < 1500


# -- parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize("content,error", [
    ("I think the first one is best.", "not JSON"),
    (answer(0.5, 0.5, ids=["1", "1"]), "duplicate trajectory IDs: 1;"),
    (answer(0.5), "Expected 2 scores, but got 1 (missing trajectory IDs: 2;"),
    (answer(0.1, 0.2, 0.3), "unexpected trajectory IDs: 3)"),
    ('{"scores": [{"trajectory_id": "1", "score": 0.5}]}', "schema"),
])
def test_unusable_answers_are_refused(content, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        parse_answer(content, 2)


def test_answers_in_prose_or_fences_parse_and_scores_are_clamped():
    scores, clamped = parse_answer("Here you go:\n```json\n" + answer(0.7, -0.2) + "\n```", 2)
    assert [s.score for s in scores] == [0.7, 0.0] and clamped == 1
    scores, clamped = parse_answer(answer(0.25, 0.75, ids=["2", "1"]), 2)  # out of order: reordered
    assert [s.score for s in scores] == [0.75, 0.25] and clamped == 0


# -- against a scripted judge ---------------------------------------------------------------


@pytest.mark.integration
async def test_errors_are_retried_counted_and_clamping_reported(judge, tmp_path):
    judge.answers = ["not json at all", answer(0.5, 0.5, 0.5, ids=["1", "1", "2"]), 503, answer(1.0, -0.2, 0.6)]
    stats = RulerStats()
    trajectories = list(group("a", "b", "c").trajectories)
    scores = await ruler(trajectories, "judge-model", judge=judge.client, cache=tmp_path, max_retries=3, stats=stats,
                         extra_params={"temperature": 0})
    assert [s.score for s in scores] == [1.0, 0.0, 0.6]
    assert (stats.judge_calls, stats.judge_errors, stats.clamped_scores) == (4, 3, 1)
    assert stats.judge_prompt_tokens == 300 and stats.judge_latency_s > 0  # the 503 reported no usage
    schema = judge.requests[0]["response_format"]["json_schema"]["schema"]
    assert schema == answer_schema(3) and judge.requests[0]["model"] == "judge-model"
    # A greedy request repeats its answer, so the retries were sampled.
    assert [r["temperature"] for r in judge.requests] == [0, 1.0, 1.0, 1.0]
    # The answer a retry got is cached under the first try's request: a rerun asks nothing.
    again = RulerStats()
    assert await ruler(trajectories, "judge-model", judge=judge.client, cache=tmp_path, stats=again,
                       extra_params={"temperature": 0}) == scores
    assert (again.cache_hits, again.judge_calls, len(judge.requests)) == (1, 0, 4)


@pytest.mark.integration
async def test_retries_are_bounded_then_raised_or_swallowed(judge):
    judge.answers = ["nope"] * 3
    with pytest.raises(JudgeError, match="3 tries"):
        await ruler(list(group("a", "b").trajectories), "m", judge=judge.client, cache=False, max_retries=2)
    assert len(judge.requests) == 3
    judge.answers = ["nope"] * 2
    original = group("a", "b", rewards=[0.3, 0.9])
    assert await ruler_score_group(original, "m", judge=judge.client, cache=False, max_retries=1,
                                   swallow_exceptions=True) is None
    assert len(judge.requests) == 5


@pytest.mark.integration
async def test_score_group_keeps_art_semantics(judge):
    judge.answers = [answer(0.9, 0.1)]
    original = group("maybe", "yes", rewards=[0.25, 0.75])
    judged = await ruler_score_group(original, "m", judge=judge.client, cache=False)
    assert [t.reward for t in judged.trajectories] == [0.9, 0.1]
    assert [t.metrics["independent_reward"] for t in judged.trajectories] == [0.25, 0.75]
    assert [t.metrics["ruler_score"] for t in judged.trajectories] == [0.9, 0.1]
    assert judged.trajectories[0].logs == ["kept", "RULER explanation: reason 1"]
    assert judged.metrics["ruler/judge_calls"] == 1 and judged.metrics["ruler/judge_errors"] == 0
    # The input group is untouched, and the choices (token ids for training) are carried over.
    assert [t.reward for t in original.trajectories] == [0.25, 0.75] and original.trajectories[0].logs == ["kept"]
    assert "independent_reward" not in original.trajectories[0].metrics
    assert judged.trajectories[0].messages_and_choices[-1].token_ids == [9001, 9002]


@pytest.mark.integration
async def test_a_cache_hit_makes_no_judge_call(judge, tmp_path):
    judge.answers = [answer(0.2, 0.8)]
    g = group("a", "b")
    first, second = RulerStats(), RulerStats()
    one = await ruler(list(g.trajectories), "m", judge=judge.client, cache=tmp_path / "c", stats=first)
    two = await ruler(list(g.trajectories), "m", judge=judge.client, cache=tmp_path / "c", stats=second)
    assert one == two and len(judge.requests) == 1
    assert (first.cache_hits, second.cache_hits, second.judge_calls) == (0, 1, 0)
    # Another rubric or other sampling settings is another question: the judge is asked again.
    judge.answers = [answer(0.3, 0.7), answer(0.4, 0.6)]
    await ruler(list(g.trajectories), "m", rubric="- other", judge=judge.client, cache=tmp_path / "c")
    await ruler(list(g.trajectories), "m", judge=judge.client, cache=tmp_path / "c",
                extra_params={"temperature": 0.0})
    assert len(judge.requests) == 3
    shutil.rmtree(tmp_path / "c")  # clearing the cache is deleting the folder
    judge.answers = [answer(0.2, 0.8)]
    await ruler(list(g.trajectories), "m", judge=judge.client, cache=tmp_path / "c")
    assert len(judge.requests) == 4


@pytest.mark.integration
async def test_a_judge_without_structured_output_is_asked_for_plain_json():
    scripted = ScriptedJudge(refuse_schemas=True)
    with ServerThread(scripted.app) as server:
        scripted.answers = [answer(0.6, 0.4), answer(0.1, 0.9)]
        stats = RulerStats()
        scores = await ruler(list(group("a", "b").trajectories), "m", judge=server.base_url + "/v1", cache=False,
                             stats=stats)
        assert [s.score for s in scores] == [0.6, 0.4] and stats.judge_errors == 0
        formats = [(r.get("response_format") or {}).get("type") for r in scripted.requests]
        assert formats == ["json_schema", "json_object"]
        # Remembered for this endpoint: the next call goes straight to what worked.
        await ruler(list(group("a", "b").trajectories), "m", judge=server.base_url + "/v1", cache=False)
        assert [(r.get("response_format") or {}).get("type") for r in scripted.requests][2:] == ["json_object"]


def test_a_missing_judge_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(art.ArtValueError, match="OPENAI_API_KEY") as missing:
        asyncio.run(ruler(list(group("a", "b").trajectories), "openai/o3", cache=False))
    assert missing.value.field == "judge"


# -- our own server as the judge --------------------------------------------------------------


@pytest.fixture(scope="module")
def long_tiny_model(tiny_model_path, tmp_path_factory):
    """The tiny random model with 4096 positions: room for a group of four and their scores."""
    out = tmp_path_factory.mktemp("tiny-4k") / "model"
    shutil.copytree(tiny_model_path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return out


@pytest.mark.integration
async def test_our_server_judges_with_structured_output_and_a_free_judge_fails_as_counted(long_tiny_model, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    judge = art.TrainableModel(name="judge", project="ruler", base_model=str(long_tiny_model))
    await judge.register(backend)
    try:
        groups = [group("yes", "no maybe", "maybe") for _ in range(50)]
        structured = [RulerStats() for _ in groups]
        results = await asyncio.gather(*(
            ruler(list(g.trajectories), str(long_tiny_model), judge=judge, cache=False, stats=s,
                  extra_params={"temperature": 1.0})
            for g, s in zip(groups, structured)))
        assert len(results) == 50 and all(len(r) == 3 and all(0 <= s.score <= 1 for s in r) for r in results)
        assert sum(s.judge_calls for s in structured) == 50 and sum(s.judge_errors for s in structured) == 0

        # The same random model without response_format never writes the JSON: every try fails,
        # is counted, and each group is dropped after 1 + max_retries tries.
        free = [RulerStats() for _ in range(4)]
        dropped = await asyncio.gather(*(
            ruler_score_group(g, str(long_tiny_model), judge=judge, cache=False, structured=False, max_retries=1,
                              swallow_exceptions=True, extra_params={"max_tokens": 24}) for g in groups[:4]))
        assert dropped == [None] * 4
        with pytest.raises(JudgeError):
            await ruler(list(groups[0].trajectories), str(long_tiny_model), judge=judge, cache=False,
                        structured=False, max_retries=1, stats=free[0], extra_params={"max_tokens": 24})
        assert (free[0].judge_calls, free[0].judge_errors) == (2, 2)
    finally:
        await backend.close()


async def rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
    messages = [{"role": "user", "content": "Say yes, no or maybe."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4, seed=seed)
    return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=0.0)


@pytest.mark.integration
async def test_the_seed_loop_trains_two_steps_on_ruler_rewards(long_tiny_model, tmp_path):
    """ART's documented loop: RULER as gather_trajectory_groups' after_each, judged by the base
    model served next to the policy (its id, no adapter)."""
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="agent", project="ruler", base_model=str(long_tiny_model))
    await model.register(backend)
    try:
        for step in range(2):
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(rollout(model, seed=100 * step + 10 * g + i) for i in range(4))
                 for g in range(2)),
                after_each=lambda g: ruler_score_group(g, model.base_model, judge=model, cache=model,
                                                       swallow_exceptions=True),
                pbar_desc=None,
            )
            assert len(groups) == 2 and all("independent_reward" in t.metrics for g in groups for t in g)
            await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        assert await model.get_step() == 2
        run = tmp_path / "ruler" / "models" / "agent"
        history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
        assert [row["step"] for row in history] == [0, 1]
        assert all(row["train/group_ruler/judge_calls"] >= 1 and "train/ruler_score" in row for row in history)
        assert len(list((run / "ruler_cache").glob("*.json"))) == 4  # the run's own judge cache
    finally:
        await backend.close()


# -- ART's helper names and an Ollama judge ------------------------------------------------------


def test_art_helper_names_answer_as_arts_do():
    assert _is_ollama_model("ollama/qwen2.5:7b") is True and _is_ollama_model("ollama_chat/qwen2.5:7b") is True
    assert _is_ollama_model("openai/gpt-4o") is False and _is_ollama_model("qwen2.5:7b") is False
    assert _is_ollama_model("openrouter/ollama/x") is False  # a prefix, not a substring
    fmt = _get_response_format_for_ollama(Response)
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Response"
    schema = fmt["json_schema"]["schema"]
    assert schema == Response.model_json_schema() and set(schema["properties"]) == {"scores"}
    # The schema is the answer the parser reads: an answer of that shape parses.
    scores, _ = parse_answer(Response.model_validate_json(answer(0.25, 0.75)).model_dump_json(), 2)
    assert [s.score for s in scores] == [0.25, 0.75]


@pytest.mark.integration
@pytest.mark.parametrize("prefix,base_suffix", [("ollama/", ""), ("ollama_chat/", "/v1")])
async def test_an_ollama_judge_is_the_local_endpoint_asked_for_the_plain_schema(monkeypatch, prefix, base_suffix):
    """`judge_model="ollama/..."` with no judge= goes where LiteLLM would send it: Ollama's
    OpenAI-compatible endpoint at OLLAMA_API_BASE, without the OpenAI key, model name unprefixed."""
    scripted = ScriptedJudge()
    with ServerThread(scripted.app) as server:
        monkeypatch.setenv("OLLAMA_API_BASE", server.base_url + base_suffix)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-ollama")
        scripted.answers = [answer(0.7, 0.3)]
        scores = await ruler(list(group("yes", "no").trajectories), prefix + "qwen2.5:7b", cache=False)
    assert [s.score for s in scores] == [0.7, 0.3]
    (request,) = scripted.requests
    assert request["model"] == "qwen2.5:7b"
    assert request["response_format"] == _get_response_format_for_ollama(Response)
    assert scripted.keys == ["ollama"]


@pytest.mark.integration
async def test_the_judge_sees_the_tools_the_agent_had(judge):
    tools = [{"type": "function", "function": {"name": "get_forecast", "description": "Tomorrow's weather",
                                              "parameters": {"type": "object", "properties": {}}}}]
    g = group("yes", "no")
    for trajectory in g.trajectories:
        trajectory.tools = tools
    judge.answers = [answer(0.6, 0.4), answer(0.5, 0.5)]
    judged = await ruler_score_group(g, "m", judge=judge.client, cache=False)
    assert [t.reward for t in judged.trajectories] == [0.6, 0.4]
    user = judge.requests[0]["messages"][1]["content"]
    assert "<available_tools>" in user and "get_forecast" in user and "Tomorrow's weather" in user
    # ART's positional order: ruler(message_lists, judge_model, extra_litellm_params, rubric, tools).
    await ruler([t.messages() for t in g.trajectories], "m", None, "- rubric", [], judge=judge.client, cache=False)
    assert "<available_tools>" not in judge.requests[1]["messages"][1]["content"]


# -- a judge that cannot tell the candidates apart -----------------------------------------------


@pytest.mark.integration
async def test_a_judge_giving_every_candidate_one_score_is_counted_and_warned_once(judge, caplog):
    """All scores equal is a group GRPO cannot learn from: counted in `ruler/uniform_groups`
    every time, warned once per judge (naming it) and only where the candidates differ."""
    identical = group("yes", "yes")
    judge.answers = [answer(0.5, 0.5), answer(0.5, 0.5, 0.5), answer(0.5, 0.5, 0.5), answer(0.9, 0.1, 0.5)]
    with caplog.at_level("WARNING", logger="art.rewards.ruler"):
        same = await ruler_score_group(identical, "weak-judge", judge=judge.client, cache=False)
        assert same.metrics["ruler/uniform_groups"] == 1.0 and not caplog.records  # alike answers, alike scores
        first = await ruler_score_group(group("yes", "no", "maybe"), "weak-judge", judge=judge.client, cache=False)
        second = await ruler_score_group(group("no", "maybe", "yes"), "weak-judge", judge=judge.client, cache=False)
        separated = await ruler_score_group(group("a", "b", "c"), "weak-judge", judge=judge.client, cache=False)
    assert [g.metrics["ruler/uniform_groups"] for g in (first, second, separated)] == [1.0, 1.0, 0.0]
    (warning,) = caplog.records
    message = warning.getMessage()
    assert "weak-judge" in message and "all 3 different trajectories" in message and "0.500" in message
    assert "stronger judge" in message and "rubric" in message and "ruler/uniform_groups" in message
    stats = RulerStats()
    judge.answers = [answer(0.25, 0.25)]
    await ruler(list(group("a", "b").trajectories), "weak-judge", judge=judge.client, cache=False, stats=stats)
    assert stats.uniform_groups == 1 and stats.as_metrics()["ruler/uniform_groups"] == 1.0


@pytest.mark.integration
async def test_the_gather_bar_shows_the_judges_scores(judge, capsys):
    """The bar's reward (and the gather's `reward_mean`) is what will train: the judge's scores,
    not the rollouts' rewards from before judging."""
    judge.answers = [answer(1.0, 0.6), answer(0.8, 0.6)]
    groups = await art.gather_trajectory_groups(
        [group("a", "b"), group("c", "d")],
        after_each=lambda g: ruler_score_group(g, "m", judge=judge.client, cache=False),
        pbar_desc="judged", pbar_total_completion_tokens=False)
    assert sorted(t.reward for g in groups for t in g.trajectories) == [0.6, 0.6, 0.8, 1.0]
    assert groups.stats.reward_mean == pytest.approx(0.75)
    bar = capsys.readouterr().err.splitlines()[-1]
    assert "judged" in bar and "reward=0.75" in bar and "independent_reward=0" in bar
