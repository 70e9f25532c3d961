"""`Trajectory.tokenize`: exact ids where the server reported them (what our trainer trains),
the chat template's rendering where it did not (what SFT renders)."""

from __future__ import annotations

import json
import math
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest

from art.exchanges import TrajectoryExchanges, build_exchange
from art.histories import ChatCompletionsHistory
from art.tokenize import (
    TokenFlag,
    TokenizedHistory,
    TokenizedMultiHistoryTrajectory,
    TokenizedTrajectory,
    TokenizedTrajectoryGroup,
)
from art.trajectories import Trajectory, TrajectoryGroup
from art.training.chat_tokens import render_chat
from art.training.sequences import sequences_of_trajectory

EXACT, SAMPLED = TokenFlag.EXACT, TokenFlag.SAMPLED


def _times(second: int) -> dict[str, datetime]:
    start = datetime(2026, 3, 1, 12) + timedelta(seconds=second)
    return {"start_time": start, "end_time": start + timedelta(milliseconds=5)}


def _logprob(token: int) -> float:
    return -token / 100


def _chat_logprobs(ids: list[int]) -> dict[str, Any]:
    return {"content": [{"token": f"token_id:{i}", "logprob": _logprob(i), "bytes": None, "top_logprobs": []}
                        for i in ids]}


def exchange(api: str, turn: int, prompt: list[int] | None, ids: list[int] | None, *, answers: list[str],
             model: str = "policy"):
    """Turn `turn` of a conversation (user "question k", assistant answers[k]) on `api`, answered
    the way our server answers, with exact ids when `prompt` and `ids` are given."""
    exact = prompt is not None
    if api == "chat_completions":
        messages = []
        for k in range(turn + 1):
            messages.append({"role": "user", "content": f"question {k}"})
            if k < turn:
                messages.append({"role": "assistant", "content": answers[k]})
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": answers[turn]}}
        if exact:
            choice.update(prompt_token_ids=prompt, token_ids=ids, logprobs=_chat_logprobs(ids or []))
        request = {"model": model, "messages": messages}
        body = {"id": f"c{turn}", "object": "chat.completion", "created": turn, "model": model, "choices": [choice]}
    elif api == "messages":
        messages = []
        for k in range(turn + 1):
            messages.append({"role": "user", "content": f"question {k}"})
            if k < turn:
                messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[k]}]})
        request = {"model": model, "max_tokens": 64, "messages": messages}
        body = {"id": f"m{turn}", "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": answers[turn]}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
        if exact:
            body.update(prompt_token_ids=prompt, token_ids=ids, logprobs=[_logprob(i) for i in ids or []])
    elif api == "responses":
        items: list[dict[str, Any]] = []
        for k in range(turn + 1):
            items.append({"role": "user", "content": f"question {k}"})
            if k < turn:
                items.append(_output_item(k, answers[k]))
        request = {"model": model, "input": items}
        body = {"id": f"r{turn}", "object": "response", "created_at": turn, "model": model, "status": "completed",
                "output": [_output_item(turn, answers[turn])], "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": []}
        if exact:
            body.update(prompt_token_ids=prompt, token_ids=ids, logprobs=_chat_logprobs(ids or []))
    else:  # completions: the prompt as token ids, as an agent that renders its own prompts sends it
        request = {"model": model, "prompt": prompt}
        choice = {"index": 0, "finish_reason": "stop", "text": answers[turn]}
        if exact:
            choice.update(prompt_token_ids=prompt, token_ids=ids,
                          logprobs={"tokens": [f"token_id:{i}" for i in ids or []],
                                    "token_logprobs": [_logprob(i) for i in ids or []],
                                    "top_logprobs": None, "text_offset": list(range(len(ids or [])))})
        body = {"id": f"p{turn}", "object": "text_completion", "created": turn, "model": model, "choices": [choice]}
    _, built = build_exchange(api, request, json.dumps(body).encode(), **_times(turn))
    return built


def _output_item(turn: int, text: str) -> dict[str, Any]:
    return {"id": f"msg_{turn}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def trajectory_of(api: str, turns: list[tuple[list[int] | None, list[int] | None]], **kwargs: Any) -> Trajectory:
    answers = [f"answer {k}" for k in range(len(turns))]
    built = [exchange(api, k, prompt, ids, answers=answers, **kwargs) for k, (prompt, ids) in enumerate(turns)]
    return Trajectory(exchanges=TrajectoryExchanges(**{api: built}), reward=0.5)


def same_floats(left: list[float], right: list[float]) -> bool:
    return len(left) == len(right) and all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(left, right))


API = ["chat_completions", "messages", "responses", "completions"]


# -- exact ids: the trainer's tokens ---------------------------------------------------------


@pytest.mark.parametrize("api", API)
def test_exact_ids_tokenize_to_what_the_trainer_trains(api):
    """The acceptance test: for every API our server answers, `tokenize` shows exactly the token
    ids, trained tokens and sampler logprobs `art.training.sequences` builds for training."""
    trajectory = trajectory_of(api, [([5, 6], [7, 8]), ([5, 6, 7, 8, 9], [10, 11, 12])])

    tokenized = trajectory.tokenize()
    sequences = sequences_of_trajectory(trajectory, Counter())

    assert tokenized.token_ids == [5, 6, 7, 8, 9, 10, 11, 12]
    assert tokenized.flags == [EXACT, EXACT, EXACT | SAMPLED, EXACT | SAMPLED, EXACT] + [EXACT | SAMPLED] * 3
    assert math.isnan(tokenized.logprobs[0]) and tokenized.logprobs[2] == _logprob(7)
    # the same tokens at the same positions, the same ones trained, with the same logprobs
    sampled = {(i, t, lp) for i, (t, lp, f) in enumerate(zip(tokenized.token_ids, tokenized.logprobs,
                                                              tokenized.flags)) if f & SAMPLED}
    trained = set()
    for sequence in sequences:
        assert sequence.token_ids == tokenized.token_ids[: len(sequence.token_ids)]
        trained |= {(i, t, lp) for i, (t, lp, on) in enumerate(zip(sequence.token_ids, sequence.sampler_logprobs,
                                                                    sequence.trained)) if on}
    assert trained == sampled
    if api != "completions":  # (the trainer reads each Completions call as its own conversation)
        assert [len(s.token_ids) for s in sequences] == [8]
        assert [bool(flag & SAMPLED) for flag in tokenized.flags] == sequences[0].trained
        assert same_floats(tokenized.logprobs, sequences[0].sampler_logprobs)
    assert isinstance(tokenized, TokenizedTrajectory) and tokenized.reward == 0.5 and tokenized.model == "policy"


@pytest.mark.parametrize("api", ["chat_completions", "messages", "responses"])
def test_a_prompt_that_does_not_extend_the_ids_is_another_history_as_the_trainer_starts_another_sequence(api):
    # the second prompt re-renders the first answer (a template that drops reasoning, say)
    trajectory = trajectory_of(api, [([5, 6], [7, 8]), ([5, 6, 70, 9], [10])])

    sequences = sequences_of_trajectory(trajectory, Counter())
    tokenized = trajectory.tokenize(multi_history=True)

    assert isinstance(tokenized, TokenizedMultiHistoryTrajectory)
    assert [h.token_ids for h in tokenized.histories] == [s.token_ids for s in sequences] == [[5, 6, 7, 8],
                                                                                              [5, 6, 70, 9, 10]]
    for history, sequence in zip(tokenized.histories, sequences):
        assert [bool(f & SAMPLED) for f in history.flags] == sequence.trained
        assert same_floats(history.logprobs, sequence.sampler_logprobs)
    with pytest.raises(ValueError, match="exactly one history; found 2"):
        trajectory.tokenize()


def test_exact_tokenizing_loads_no_tokenizer(monkeypatch):
    monkeypatch.setattr("art.tokenize._load_tokenizer", lambda name: pytest.fail("loaded a tokenizer"))
    trajectory = trajectory_of("chat_completions", [([1], [2]), ([1, 2, 3], [4])])
    assert trajectory.tokenize().token_ids == [1, 2, 3, 4]
    converted = trajectory_of("messages", [([1, 2], [3])]).anthropic_messages_history().as_chat_completions_history()
    assert converted.tokenize().flags == [EXACT, EXACT, EXACT | SAMPLED]


def test_legacy_trajectory_tokenizes_from_its_choices_ids_with_a_model():
    captured = trajectory_of("chat_completions", [([1], [2]), ([1, 2, 3], [4])])
    legacy = Trajectory(messages_and_choices=captured.messages_and_choices, reward=1.0)

    with pytest.raises(ValueError, match="requires model="):
        legacy.tokenize()
    tokenized = legacy.tokenize(model="policy")
    sequence = sequences_of_trajectory(legacy, Counter())[0]
    assert tokenized.token_ids == sequence.token_ids == [1, 2, 3, 4]
    assert tokenized.flags == [EXACT, EXACT | SAMPLED, EXACT, EXACT | SAMPLED]
    assert same_floats(tokenized.logprobs, sequence.sampler_logprobs)


def test_malformed_exact_ids_are_refused():
    trajectory = trajectory_of("chat_completions", [([1], [2])])
    trajectory.exchanges.chat_completions[0].response.choices[0].model_extra["prompt_token_ids"] = [1, "two"]
    with pytest.raises(ValueError, match="invalid exact token ID"):
        trajectory.tokenize()


def test_group_tokenize_keeps_each_reward_and_the_group_metrics():
    first = trajectory_of("chat_completions", [([1], [2])])
    second = trajectory_of("chat_completions", [([1], [3])])
    second.reward = 1.0
    group = TrajectoryGroup([first, second], metrics={"solved": 1}, metadata={"task": "t1"})

    tokenized = group.tokenize()

    assert isinstance(tokenized, TokenizedTrajectoryGroup)
    assert [t.token_ids for t in tokenized.trajectories] == [[1, 2], [1, 3]]
    assert [t.reward for t in tokenized.trajectories] == [0.5, 1.0]
    assert tokenized.metrics == {"solved": 1} and tokenized.metadata == {"task": "t1"}
    assert isinstance(group.tokenize(multi_history=True).trajectories[0], TokenizedMultiHistoryTrajectory)


# -- sources must still match ----------------------------------------------------------------


def test_an_edited_history_is_refused_where_it_no_longer_matches_its_exchange():
    history = trajectory_of("chat_completions", [([1], [2])]).chat_completions_history()
    history.messages.append({"role": "user", "content": "more"})
    with pytest.raises(ValueError, match="differ in length"):
        history.tokenize()
    history.message_sources.append(None)
    history.messages[0] = {"role": "user", "content": "edited"}
    with pytest.raises(ValueError, match="no longer matches its source exchange"):
        history.tokenize()

    history = trajectory_of("messages", [([1], [2])]).anthropic_messages_history()
    history.model = "someone/else"
    with pytest.raises(ValueError, match="model no longer matches"):
        history.tokenize()


def test_completions_token_history_drops_exactness_of_an_edited_prompt_and_refuses_an_edited_sample():
    history = trajectory_of("completions", [([1, 2], [3])]).completions_token_history()
    assert history.tokenize().flags == [EXACT, EXACT, EXACT | SAMPLED]
    history.prompt[0] = 99
    assert history.tokenize().flags == [TokenFlag(0), TokenFlag(0), EXACT | SAMPLED]
    history.prompt[-1] = 98
    with pytest.raises(ValueError, match="sampled output no longer matches"):
        history.tokenize()
    history.prompt[-1] = 3
    history.sampled_spans = [(0, 3)]
    with pytest.raises(ValueError, match="exactly match choice-backed"):
        history.tokenize()


class WordTokenizer:
    """A stand-in tokenizer: one id per word, and a chat template that writes each message as
    `<role> words <end>` (id 1 for <end>), with `<assistant>` as the generation prompt."""

    eos_token_id = 1
    VOCAB = {"<end>": 1, "<user>": 2, "<assistant>": 3}

    def __call__(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [self.VOCAB.setdefault(word, len(self.VOCAB) + 1) for word in text.split()]

    def apply_chat_template(self, messages, *, tools=None, tokenize=True, add_generation_prompt=False, **kwargs):
        text = " ".join(f"<{m['role']}> {m.get('content') or ''} <end>" for m in messages)
        return self(text + (" <assistant>" if add_generation_prompt else ""))


def test_without_ids_the_template_renders_and_user_messages_are_context():
    history = trajectory_of("chat_completions", [(None, None)]).chat_completions_history()
    history.messages.append({"role": "user", "content": "thanks"})
    history.message_sources.append(None)
    tokenizer = WordTokenizer()

    tokenized = history.tokenize(tokenizer=tokenizer)

    words = "<user> question 0 <end> <assistant> answer 0 <end> <user> thanks <end> <assistant>"
    assert tokenized.token_ids == tokenizer(words)
    assert [bool(f & SAMPLED) for f in tokenized.flags] == [False] * 5 + [True] * 3 + [False] * 4
    assert not any(f & EXACT for f in tokenized.flags)
    assert all(math.isnan(v) for v in tokenized.logprobs)


def test_completions_text_history_tokenizes_its_text_with_the_tokenizer():
    trajectory = trajectory_of("completions", [(None, None)])
    trajectory.exchanges.completions[0].request["prompt"] = "say hi"
    history = trajectory.completions_string_history()
    tokenized = history.tokenize(tokenizer=WordTokenizer())
    assert tokenized.token_ids == WordTokenizer()("say hi answer 0")
    assert tokenized.flags == [TokenFlag(0)] * 2 + [SAMPLED] * 2


def test_tokenized_lists_must_align():
    with pytest.raises(ValueError, match="differ in length"):
        TokenizedHistory(model="m", token_ids=[1, 2], logprobs=[0.0], flags=[EXACT, EXACT])


# -- a real chat template (SmolLM2's, offline) -----------------------------------------------


@pytest.fixture(scope="module")
def smol(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


CONVERSATION = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]


def test_rendering_marks_the_tokens_sft_trains(smol, tiny_model_path):
    legacy = Trajectory(messages_and_choices=CONVERSATION)
    rendered = render_chat(smol, CONVERSATION)

    tokenized = legacy.tokenize(model="policy", tokenizer=smol)
    by_name = legacy.tokenize(model="policy", base_model=str(tiny_model_path))

    assert tokenized.token_ids == rendered.token_ids == by_name.token_ids
    assert tokenized.flags == by_name.flags
    # message dicts are context: nothing sampled (SFT trains them, GRPO does not)
    assert not any(tokenized.flags)
    chat = ChatCompletionsHistory("policy", CONVERSATION, [None] * 4)
    assert chat.tokenize(tokenizer=smol).token_ids == rendered.token_ids


def test_exact_and_rendered_tokens_agree_when_the_server_rendered_with_the_same_template(smol):
    def ids(messages, generation):
        return list(smol.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation,
                                             return_dict=False))

    first_prompt = ids(CONVERSATION[:1], True)
    first = ids(CONVERSATION[:2], False)[len(first_prompt):]
    first = first[: first.index(smol.eos_token_id) + 1]
    second_prompt = ids(CONVERSATION[:3], True)
    second = ids(CONVERSATION, False)[len(second_prompt):]
    second = second[: second.index(smol.eos_token_id) + 1]
    answers = ["4", "6"]
    built = [exchange("chat_completions", 0, first_prompt, first, answers=answers),
             exchange("chat_completions", 1, second_prompt, second, answers=answers)]
    for exchange_, messages in zip(built, (CONVERSATION[:1], CONVERSATION[:3])):
        exchange_.request["messages"] = messages
    trajectory = Trajectory(exchanges=TrajectoryExchanges(chat_completions=built))
    exact = trajectory.tokenize()

    # a chat_template= other than the one the calls used renders (here: the same text, passed explicitly)
    rendered = trajectory.chat_completions_history().tokenize(tokenizer=smol, chat_template=smol.chat_template)

    # the template writes a newline after the last turn's end token: context the server never sampled
    assert rendered.token_ids == [*exact.token_ids, *smol("\n", add_special_tokens=False)["input_ids"]]
    assert not rendered.flags[-1]
    assert [bool(f & SAMPLED) for f in rendered.flags[:-1]] == [bool(f & SAMPLED) for f in exact.flags]
    assert all(f & EXACT for f in exact.flags)
    # the rendered sampled spans equal the server's ids, so they are marked exact with their logprobs
    sampled = [i for i, f in enumerate(rendered.flags) if f & SAMPLED]
    assert all(rendered.flags[i] & EXACT for i in sampled)
    assert same_floats(rendered.logprobs[:-1], exact.logprobs)



def test_a_responses_history_with_reasoning_tokenizes_through_its_chat_view():
    items = [{"role": "user", "content": "question 0"}]
    reasoning = {"id": "rs_0", "type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]}
    body = {"id": "r0", "object": "response", "created_at": 0, "model": "policy", "status": "completed",
            "output": [reasoning, _output_item(0, "answer 0")], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": []}
    _, built = build_exchange("responses", {"model": "policy", "input": items}, json.dumps(body).encode(), **_times(0))
    history = Trajectory(exchanges=TrajectoryExchanges(responses=[built])).responses_history()

    chat = history.as_chat_completions_history()
    assert chat.messages[-1] == {"role": "assistant", "content": "answer 0", "reasoning": "think"}
    tokenized = history.tokenize(tokenizer=WordTokenizer())
    assert tokenized.token_ids == WordTokenizer()("<user> question 0 <end> <assistant> answer 0 <end>")
    assert [bool(f & SAMPLED) for f in tokenized.flags] == [False] * 5 + [True] * 3

    history.previous_response_id = "resp_elsewhere"  # context the template cannot see
    with pytest.raises(ValueError, match="opaque context"):
        history.tokenize(tokenizer=WordTokenizer())


def test_a_legacy_history_tokenizes_itself_with_a_model():
    captured = trajectory_of("messages", [([1, 2], [3])])
    history = Trajectory(messages_and_choices=captured.messages_and_choices).histories()[0]
    assert history.tokenize(model="policy").token_ids == [1, 2, 3]
    assert [m["role"] for m in history.as_chat_completions_history(model="policy").messages] == ["user", "assistant"]
