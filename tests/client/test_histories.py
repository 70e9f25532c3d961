"""Exchanges as ART's histories: one per conversation, per API, per model, with their sources."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest

import art
from art.exchanges import TrajectoryExchanges, build_exchange
from art.histories import (
    AnthropicMessagesHistory,
    ChatCompletionsHistory,
    CompletionsTokenHistory,
    History,
    ResponsesHistory,
)
from art.trajectories import LegacyHistory, Trajectory


def _times(second: int) -> dict[str, datetime]:
    start = datetime(2026, 3, 1, 12) + timedelta(seconds=second)
    return {"start_time": start, "end_time": start + timedelta(milliseconds=5)}


def chat(messages: list[dict[str, Any]], answer: Any, *, model: str = "policy", second: int = 0,
         choices: list[dict[str, Any]] | None = None, **request: Any):
    """A Chat Completions exchange, built from the answer's raw JSON as a capture builds it."""
    message = answer if isinstance(answer, dict) else {"role": "assistant", "content": answer}
    body = {"id": f"chat-{second}", "object": "chat.completion", "created": second, "model": model,
            "choices": choices if choices is not None else [{"index": 0, "finish_reason": "stop", "message": message}]}
    _, exchange = build_exchange("chat_completions", {"model": model, "messages": messages, **request},
                                 json.dumps(body).encode(), **_times(second))
    return exchange


def anthropic(messages: list[dict[str, Any]], blocks: list[dict[str, Any]], *, second: int = 0, **request: Any):
    body = {"id": f"msg-{second}", "type": "message", "role": "assistant", "model": "policy", "content": blocks,
            "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
    _, exchange = build_exchange("messages", {"model": "policy", "max_tokens": 32, "messages": messages, **request},
                                 json.dumps(body).encode(), **_times(second))
    return exchange


def response(response_id: str, request_input: Any, text: str, *, second: int = 0, reasoning: str | None = None,
             **request: Any):
    output: list[dict[str, Any]] = []
    if reasoning is not None:
        output.append({"id": f"rs-{response_id}", "type": "reasoning",
                       "summary": [{"type": "summary_text", "text": reasoning}]})
    output.append({"id": f"msg-{response_id}", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]})
    body = {"id": response_id, "object": "response", "created_at": second, "model": "policy", "status": "completed",
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    _, exchange = build_exchange("responses", {"model": "policy", "input": request_input, **request},
                                 json.dumps(body).encode(), **_times(second))
    return exchange


def completion(prompt: Any, choices: list[dict[str, Any]], *, second: int = 0, **request: Any):
    body = {"id": f"cmpl-{second}", "object": "text_completion", "created": second, "model": "policy",
            "choices": [{"index": i, "finish_reason": "stop", "text": "", **c} for i, c in enumerate(choices)]}
    _, exchange = build_exchange("completions", {"model": "policy", "prompt": prompt, **request},
                                 json.dumps(body).encode(), **_times(second))
    return exchange


USER_1 = {"role": "user", "content": "one"}
USER_2 = {"role": "user", "content": "two"}


def two_turns(**first_request: Any):
    first = chat([USER_1], "first", **first_request)
    second = chat([USER_1, {"role": "assistant", "content": "first"}, USER_2], "second", second=1, **first_request)
    return first, second


# -- Chat Completions ------------------------------------------------------------------------


def test_a_growing_conversation_is_one_history_whose_sources_name_the_calls():
    first, second = two_turns()
    trajectory = Trajectory(exchanges=TrajectoryExchanges(chat_completions=[first, second]))

    history = trajectory.history()

    assert isinstance(history, ChatCompletionsHistory) and isinstance(history, History)
    assert history.model == "policy"
    assert [m["content"] for m in history.messages] == ["one", "first", "two", "second"]
    # where each message came from: the first call's request and choice, then the second's
    assert [(s.exchange is first, s.request_index, s.choice_index) for s in history.message_sources] == [
        (True, 0, None), (True, None, 0), (False, 2, None), (False, None, 0)]
    assert history.messages[0] is not first.request["messages"][0]  # a copy: editing it leaves the capture alone
    assert trajectory.chat_completions_history() == history
    second.request["messages"] = [{"role": "user", "content": "something else"}]
    assert len(trajectory.chat_completions_histories()) == 2
    with pytest.raises(ValueError, match="exactly one history; found 2"):
        trajectory.chat_completions_history()


def test_model_selects_by_name_or_pattern_and_several_models_need_it():
    policy = chat([USER_1], "a", model="policy@3")
    judge = chat([{"role": "user", "content": "grade"}], "9", model="judge", second=1)
    later = chat([USER_2], "b", model="policy@4", second=2)
    trajectory = Trajectory(exchanges=TrajectoryExchanges(chat_completions=[policy, judge, later]))

    with pytest.raises(ValueError, match="requires exactly one model; pass model="):
        trajectory.history()
    assert trajectory.history(model="judge").messages[-1]["content"] == "9"
    assert [h.model for h in trajectory.histories(model="policy@*")] == ["policy@3", "policy@4"]
    assert trajectory.history(model="policy@4").model == "policy@4"  # an exact name is not a pattern
    with pytest.raises(ValueError, match="no Chat Completions exchanges for model 'other'"):
        trajectory.chat_completions_histories(model="other")
    with pytest.raises(ValueError, match="no Anthropic Messages exchanges"):
        trajectory.anthropic_messages_histories()


def test_each_choice_of_a_call_is_its_own_branch_and_the_first_one_continues():
    choices = [{"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": "same"}}
               for i in (1, 0)]
    first = chat([USER_1], None, choices=choices)
    continued = chat([USER_1, {"role": "assistant", "content": "same"}, USER_2], "more", second=1)

    histories = Trajectory(exchanges=TrajectoryExchanges(chat_completions=[first, continued])).histories()

    assert [len(h.messages) for h in histories] == [4, 2]
    assert [h.message_sources[1].choice_index for h in histories] == [0, 1]


def test_answers_are_normalised_so_the_next_request_continues_them():
    first = chat([USER_1], {"role": "assistant", "content": None, "tool_calls": [], "annotations": []})
    second = chat([USER_1, {"role": "assistant", "content": ""}, USER_2], "ok", second=1)

    history = Trajectory(exchanges=TrajectoryExchanges(chat_completions=[first, second])).history()

    assert history.messages[1] == {"role": "assistant", "content": ""}
    assert history.message_sources[1].exchange is first


@pytest.mark.parametrize("indices, problem", [([], "no choices"), ([0, 0], "duplicate choice indices")])
def test_answers_without_choices_or_with_repeated_indices_are_refused(indices, problem):
    choices = [{"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}
               for i in indices]
    exchange = chat([USER_1], None, choices=choices)
    with pytest.raises(ValueError, match=problem):
        Trajectory(exchanges=TrajectoryExchanges(chat_completions=[exchange])).chat_completions_histories()


def test_a_request_that_only_repeats_an_answer_is_sourced_to_itself():
    first = chat([USER_1], "same")
    seeded = chat([{"role": "assistant", "content": "same"}], "next", second=1)
    histories = Trajectory(exchanges=TrajectoryExchanges(chat_completions=[first, seeded])).histories()
    source = histories[1].message_sources[0]
    assert source.exchange is seeded and source.request_index == 0


def test_a_changed_tool_list_starts_another_history():
    first, second = two_turns()
    second.request["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    histories = Trajectory(exchanges=TrajectoryExchanges(chat_completions=[first, second])).histories()
    assert [h.tools for h in histories] == [None, second.request["tools"]]
    assert histories[1].message_sources[1].exchange is first  # the repeated answer keeps its source


def test_a_dropped_reasoning_turn_splits_the_history_but_keeps_the_source():
    first = chat([USER_1], {"role": "assistant", "content": "first", "reasoning_content": "hmm"})
    second = chat([USER_1, {"role": "assistant", "content": "first"}, USER_2], "second", second=1)
    histories = Trajectory(exchanges=TrajectoryExchanges(chat_completions=[first, second])).histories()
    assert [len(h.messages) for h in histories] == [2, 4]
    assert histories[0].messages[1]["reasoning_content"] == "hmm"
    assert histories[1].message_sources[1].exchange is first
    assert histories[1].message_sources[1].choice_index == 0


def test_several_apis_need_the_api_named():
    both = Trajectory(exchanges=TrajectoryExchanges(
        chat_completions=[chat([USER_1], "a")],
        messages=[anthropic([{"role": "user", "content": "hi"}], [{"type": "text", "text": "yo"}], second=1)]))
    with pytest.raises(ValueError, match="multiple protocol histories; use a protocol-specific method"):
        both.history()
    assert isinstance(both.anthropic_messages_history(), AnthropicMessagesHistory)


# -- Anthropic Messages ----------------------------------------------------------------------


def test_anthropic_history_keeps_its_system_and_converts_to_chat_with_sources():
    request = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                                            {"type": "text", "text": "go on"}]}]
    exchange = anthropic(request, [{"type": "text", "text": "done"}], system="Be brief")
    trajectory = Trajectory(exchanges=TrajectoryExchanges(messages=[exchange]))

    history = trajectory.anthropic_messages_history()
    assert history.system == "Be brief" and history.system_source is exchange
    assert not hasattr(history, "model_dump")  # a dataclass, as ART's
    assert [m["role"] for m in history.messages] == ["user", "assistant"]

    chat_view = history.as_chat_completions_history()
    assert [m["role"] for m in chat_view.messages] == ["system", "tool", "user", "assistant"]
    assert [(s.request_index, s.output_index) for s in chat_view.message_sources[1:]] == [(0, None), (0, None),
                                                                                          (None, 0)]


def test_anthropic_new_system_prompt_is_another_history_sourced_to_its_request():
    first = anthropic([{"role": "user", "content": "Hello"}], [{"type": "text", "text": "Hi"}], system="old")
    second = anthropic([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                        {"role": "user", "content": "Again"}], [{"type": "text", "text": "Hi again"}],
                       second=1, system="new")
    histories = Trajectory(exchanges=TrajectoryExchanges(messages=[first, second])).anthropic_messages_histories()
    assert [h.system for h in histories] == ["old", "new"]
    assert histories[1].system_source is second


def test_anthropic_content_that_is_neither_text_nor_blocks_is_refused():
    exchange = anthropic([{"role": "user", "content": "x"}], [{"type": "text", "text": "y"}])
    exchange.request["messages"] = [{"role": "user", "content": None}]
    with pytest.raises(ValueError, match="Anthropic message content must be text or a list"):
        Trajectory(exchanges=TrajectoryExchanges(messages=[exchange])).anthropic_messages_histories()


# -- Responses -------------------------------------------------------------------------------


def test_previous_response_id_brings_the_earlier_turn_back():
    first = response("resp-1", "turn 0", "first", reasoning="think")
    second = response("resp-2", "turn 1", "second", second=1, previous_response_id="resp-1")
    trajectory = Trajectory(exchanges=TrajectoryExchanges(responses=[first, second]))

    history = trajectory.responses_history()
    assert isinstance(history, ResponsesHistory)
    assert [item.get("type", "message") for item in history.input] == ["message", "reasoning", "message", "message",
                                                                       "message"]
    assert history.input_sources[1].exchange is first and history.input_sources[1].output_index == 0

    chat_view = history.as_chat_completions_history()
    assert [m["role"] for m in chat_view.messages] == ["user", "assistant", "user", "assistant"]
    assert chat_view.messages[1]["reasoning"] == "think"
    assert chat_view.message_sources[1].output_index == 0  # reasoning and message: one assistant turn

    second.request["previous_response_id"] = "resp-outside"
    histories = trajectory.responses_histories()
    assert len(histories) == 2 and histories[1].previous_response_id == "resp-outside"
    with pytest.raises(ValueError, match="Opaque Responses context"):
        histories[1].as_chat_completions_history()


def test_instructions_are_context_with_their_source():
    first = response("r1", "hi", "a", instructions="old")
    second = response("r2", "again", "b", second=1, previous_response_id="r1", instructions="new")
    histories = Trajectory(exchanges=TrajectoryExchanges(responses=[first, second])).responses_histories()
    assert histories[-1].instructions == "new" and histories[-1].instructions_source is second


# -- Completions -----------------------------------------------------------------------------


def test_completions_token_history_keeps_ids_and_sampled_spans():
    first = completion([1], [{"prompt_token_ids": [1], "token_ids": [2]}])
    second = completion([1, 2, 3], [{"prompt_token_ids": [1, 2, 3], "token_ids": [4]}], second=1)
    trajectory = Trajectory(exchanges=TrajectoryExchanges(completions=[first, second]))

    history = trajectory.history()
    assert isinstance(history, CompletionsTokenHistory)
    assert history.prompt == [1, 2, 3, 4] and history.sampled_spans == [(1, 2), (3, 4)]
    assert [(s.start, s.end, s.source.choice_index) for s in history.prompt_sources] == [
        (0, 1, None), (1, 2, 0), (2, 3, None), (3, 4, 0)]
    with pytest.raises(ValueError, match="no chat-message structure"):
        history.as_chat_completions_history()


def test_batched_completions_pair_choices_with_prompts():
    exchange = completion(["first", "second"], [{"prompt_token_ids": [p], "token_ids": [100 + i]}
                                                for i, p in enumerate((1, 1, 2, 2))])
    trajectory = Trajectory(exchanges=TrajectoryExchanges(completions=[exchange]))
    assert [h.prompt for h in trajectory.completions_token_histories()] == [[1, 100], [1, 101], [2, 102], [2, 103]]
    with pytest.raises(ValueError, match="exactly one history"):
        trajectory.history()

    by_ids = completion([[1], [2]], [{"prompt_token_ids": [2], "token_ids": [20]},
                                     {"prompt_token_ids": [1], "token_ids": [10]}])
    assert [h.prompt for h in Trajectory(exchanges=TrajectoryExchanges(completions=[by_ids]))
            .completions_token_histories()] == [[1, 10], [2, 20]]


def test_completions_without_ids_fall_back_to_text_and_refuse_what_they_cannot_place():
    text_only = completion("question", [{"text": "answer"}])
    history = Trajectory(exchanges=TrajectoryExchanges(completions=[text_only])).history()
    assert history.prompt == "questionanswer" and history.sampled_spans == [(8, 14)]

    suffixed = completion("q", [{"text": "a"}], suffix="tail")
    with pytest.raises(ValueError, match="suffix is not supported"):
        Trajectory(exchanges=TrajectoryExchanges(completions=[suffixed])).histories()
    unpaired = completion(["a", "b"], [{"text": "x"}])
    with pytest.raises(ValueError, match="associate Completions choices"):
        Trajectory(exchanges=TrajectoryExchanges(completions=[unpaired])).histories()


# -- legacy trajectories ---------------------------------------------------------------------


def test_a_trajectory_without_exchanges_has_legacy_histories():
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "primary"}],
                            additional_histories=[LegacyHistory(messages_and_choices=[USER_2])])

    found = trajectory.histories()
    assert [type(h) for h in found] == [LegacyHistory, LegacyHistory]
    assert found[0].messages_and_choices == [{"role": "user", "content": "primary"}]
    found[0].messages_and_choices.append(USER_1)
    assert len(trajectory.messages_and_choices) == 1  # copies
    assert [len(h.messages) for h in trajectory.chat_completions_histories()] == [1, 1]
    with pytest.raises(ValueError, match="exactly one history"):
        trajectory.history()
    single = Trajectory(messages_and_choices=[USER_1])
    assert isinstance(single.history(model="anything"), LegacyHistory)
    assert single.chat_completions_history(model="m").message_sources == [None]


def test_top_level_names_are_the_history_classes():
    assert art.Trajectory is Trajectory
    assert issubclass(ChatCompletionsHistory, History)
