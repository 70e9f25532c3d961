"""RULER as ART's: judge calls charged as `costs/<context>/judge/ruler` (every retry), a retry
that shows the judge its bad answer and names the wrong ids, ART's ValueError after two calls,
and scores read on the scale the judge wrote them in.

The judge is a scripted OpenAI-compatible server on loopback (the hosted judges ART names,
OpenAI and OpenRouter, cannot be reached here), found the way a user's code finds the real one:
through `OPENAI_BASE_URL`, `OPENROUTER_API_BASE` or `OLLAMA_API_BASE`, with `judge=None`.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi import FastAPI, Request

import art
from art.errors import JudgeError
from art.metrics import MetricsBuilder
from art.rewards import RulerAnswerError, ruler, ruler_score_group
from art.rewards.judge_answer import parse_answer
from art.server.thread import ServerThread


TWO = [[{"role": "user", "content": "first"}], [{"role": "user", "content": "second"}]]


def scores_for(*ids: str, scale: float = 10) -> str:
    """An answer scoring each id as int(id) / scale."""
    return json.dumps({"scores": [{"trajectory_id": i, "explanation": f"Trajectory {i}.", "score": int(i) / scale}
                                  for i in ids]})


class Judge:
    """Answers chat completions from `answers` (text, or (text, usage extras)) and records each
    request. Once `hold_from` requests have come, the next one waits until `release` is set."""

    def __init__(self) -> None:
        self.answers: list = []
        self.requests: list[dict] = []
        self.hold_from: int | None = None
        self.held = threading.Event()
        self.release = threading.Event()
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            if self.hold_from is not None and len(self.requests) > self.hold_from:
                self.held.set()
                await asyncio.to_thread(self.release.wait)
            reply = self.answers.pop(0)
            content, extra = reply if isinstance(reply, tuple) else (reply, {})
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": content}}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150, **extra}}

        self.app = app


@pytest.fixture
def judge(monkeypatch):
    scripted = Judge()
    with ServerThread(scripted.app) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url + "/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("OPENROUTER_API_BASE", server.base_url + "/v1")
        monkeypatch.setenv("OPENROUTER_API_KEY", "or-test")
        monkeypatch.setenv("OLLAMA_API_BASE", server.base_url)
        yield scripted
        scripted.release.set()


async def judged(builder: MetricsBuilder, messages, judge_model: str):
    """`ruler` run with `builder` active; (scores, what the builder flushes)."""
    token = builder.activate()
    try:
        scores = await ruler(messages, judge_model=judge_model, cache=False)
    finally:
        token.var.reset(token)
    return scores, await builder.flush()


# -- costs --------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_a_priced_judge_is_charged_under_judge_ruler(judge):
    judge.answers = [scores_for("1", scale=1 / 0.9)]
    scores, metrics = await judged(MetricsBuilder(cost_context="train"), TWO[:1], "openai/gpt-4.1")
    assert scores[0].score == pytest.approx(0.9) and judge.requests[0]["model"] == "gpt-4.1"
    # 100 prompt tokens at $2 and 50 completion tokens at $8 per million (openai/gpt-4.1's prices).
    for key in ("costs/train/judge/ruler", "costs/train/judge", "costs/train", "costs/all",
                "costs/cum/train/judge/ruler"):
        assert metrics[key] == pytest.approx(0.0006), key


@pytest.mark.integration
async def test_a_judge_without_a_price_costs_nothing(judge):
    judge.answers = [scores_for("1", scale=10 / 7)]
    scores, metrics = await judged(MetricsBuilder(cost_context="train"), TWO[:1], "ollama/qwen3:32b")
    assert scores[0].score == pytest.approx(0.7)
    assert judge.requests[0]["model"] == "qwen3:32b" and not any(k.startswith("costs/") for k in metrics)


@pytest.mark.integration
async def test_openrouters_reported_cost_is_charged_for_every_try(judge):
    judge.answers = [(scores_for("1"), {"cost": 0.01}), (scores_for("1", "2"), {"cost": 0.02})]
    scores, metrics = await judged(MetricsBuilder(cost_context="train"), TWO, "openrouter/openai/gpt-4.1-mini")
    assert len(scores) == 2 and len(judge.requests) == 2
    assert judge.requests[0]["model"] == "openai/gpt-4.1-mini"
    assert metrics["costs/train/judge/ruler"] == pytest.approx(0.03)


@pytest.mark.integration
async def test_judging_inside_a_models_eval_context_reaches_its_val_row(judge, tmp_path):
    model = art.Model(name="judged", project="ruler", base_path=str(tmp_path), report_metrics=[])
    group = art.TrajectoryGroup(art.Trajectory(messages_and_choices=[*m, {"role": "assistant", "content": "ok"}],
                                               reward=0.0) for m in TWO)
    judge.answers = [scores_for("1", "2")]
    token = model.activate_metrics_context("eval")
    try:
        scored = await ruler_score_group(group, "openai/gpt-4.1", cache=False)
    finally:
        token.var.reset(token)
    await model.log(scored, split="val", step=0)
    row = json.loads((tmp_path / "ruler" / "models" / "judged" / "history.jsonl").read_text().splitlines()[0])
    assert row["costs/eval/judge/ruler"] == pytest.approx(0.0006) and row["val/reward"] == pytest.approx(0.15)


# -- retries ------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("returned,missing,unexpected", [(["1"], "2", "none"), (["1", "2", "3"], "none", "3")])
async def test_a_retry_shows_the_judge_its_answer_and_the_wrong_ids(judge, returned, missing, unexpected):
    judge.answers = [scores_for(*returned), scores_for("1", "2")]
    scores = await ruler(TWO, cache=False)
    assert [s.trajectory_id for s in scores] == ["1", "2"] and len(judge.requests) == 2
    first, retry = (r["messages"] for r in judge.requests)
    assert len(first) == 2 and "exactly 2 score objects" in first[0]["content"] and "1, 2" in first[0]["content"]
    assert retry[:2] == first and retry[2] == {"role": "assistant", "content": scores_for(*returned)}
    correction = retry[3]["content"]
    assert f"had {len(returned)} score object" in correction
    assert f"Missing trajectory IDs: {missing}" in correction and "Duplicate trajectory IDs: none" in correction
    assert f"Unexpected trajectory IDs: {unexpected}" in correction
    assert "using each trajectory ID exactly once: 1, 2" in correction


@pytest.mark.integration
async def test_a_repeated_id_is_named_and_scores_come_in_id_order(judge):
    judge.answers = [scores_for("1", "1"), scores_for("2", "1")]
    scores = await ruler(TWO, cache=False)
    correction = judge.requests[1]["messages"][3]["content"]
    assert "Missing trajectory IDs: 2" in correction and "Duplicate trajectory IDs: 1" in correction
    assert [(s.trajectory_id, s.score) for s in scores] == [("1", pytest.approx(0.1)), ("2", pytest.approx(0.2))]


@pytest.mark.integration
async def test_answers_that_stay_wrong_raise_arts_value_error_after_two_calls(judge):
    judge.answers = [scores_for("1"), scores_for("1")]
    with pytest.raises(ValueError, match="Expected 2 scores, but got 1") as raised:
        await ruler(TWO, cache=False)
    assert isinstance(raised.value, RulerAnswerError) and isinstance(raised.value, JudgeError)
    assert len(judge.requests) == 2 and "Missing trajectory IDs: 2" in judge.requests[1]["messages"][3]["content"]
    # An answer that is not JSON at all is shown back too, and fails the same way.
    judge.answers = ["I prefer the first.", "Still the first."]
    with pytest.raises(RulerAnswerError, match="not JSON"):
        await ruler(TWO, cache=False)
    assert judge.requests[3]["messages"][2:3] == [{"role": "assistant", "content": "I prefer the first."}]


@pytest.mark.integration
async def test_cancelling_during_a_retry_propagates(judge):
    judge.answers = [scores_for("1"), scores_for("1", "2")]
    judge.hold_from = 1
    task = asyncio.ensure_future(ruler(TWO, cache=False))
    await asyncio.to_thread(judge.held.wait)  # the retry is in flight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(judge.requests) == 2


# -- scales --------------------------------------------------------------------------------------


@pytest.mark.parametrize("written,expected", [
    ([8, 4], [0.8, 0.4]),             # a 0-10 scale
    ([80, 45], [0.8, 0.45]),          # a 0-100 scale
    (["8/10", "40%"], [0.8, 0.4]),    # each says its own scale
    (["0.3", 0.6], [0.3, 0.6]),       # already in [0, 1]
    ([7, "1/2"], [0.7, 0.5]),         # the fraction does not set the others' scale
])
def test_scores_are_read_on_the_scale_they_are_written_in(written, expected):
    content = json.dumps({"scores": [{"trajectory_id": i + 1, "explanation": "e", "score": s}
                                     for i, s in enumerate(written)]})
    scores, clamped = parse_answer(content, 2)
    assert [s.score for s in scores] == pytest.approx(expected) and clamped == 0
    assert [s.trajectory_id for s in scores] == ["1", "2"]


def test_a_score_that_is_no_number_names_the_trajectory():
    content = json.dumps({"scores": [{"trajectory_id": "1", "explanation": "e", "score": "good"},
                                     {"trajectory_id": "2", "explanation": "e", "score": "3/0"}]})
    with pytest.raises(ValueError, match="trajectory '1' has score 'good'"):
        parse_answer(content, 2)
    with pytest.raises(ValueError, match="trajectory '2' has score '3/0'"):
        parse_answer(content.replace('"good"', '"1/2"'), 2)


def test_an_openrouter_judge_without_a_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(art.ArtValueError, match="OPENROUTER_API_KEY") as missing:
        asyncio.run(ruler(TWO, "openrouter/openai/gpt-4.1-mini", cache=False))
    assert missing.value.field == "judge_api_key"
