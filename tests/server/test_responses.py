"""POST /v1/responses through the official `openai` client against a tiny random model.

A Responses request is served as the chat request it means, so the same seeded (or greedy)
chat request must sample exactly the same ids from exactly the same prompt; the `Response`
carries them (`token_ids`, `prompt_token_ids`, `logprobs`, `step`), whole or streamed. Tool
calls are forced by `tool_choice` (a random model never calls on its own) and sent back the
way the Agents SDK sends them; bad input is a 400 naming the field.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from art.server.app import create_app
from art.server.thread import ServerThread
from tests.support.registry import SingleModelRegistry

pytestmark = pytest.mark.integration

MODEL = "tiny"
PICK = {"type": "function", "name": "pick", "description": "Pick a letter.", "strict": True,
        "parameters": {"type": "object", "properties": {"x": {"type": "string", "enum": ["a", "b"]}},
                       "required": ["x"], "additionalProperties": False}}
CHAT_PICK = {"type": "function", "function": {k: v for k, v in PICK.items() if k != "type"}}


@pytest.fixture(scope="module")
def server(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from art.engine.llm_engine import LLMEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with ServerThread(create_app(SingleModelRegistry(LLMEngine(model, tokenizer), MODEL))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def extra(response) -> dict:
    return response.model_extra or {}


def assert_same_sample(response, chat_choice) -> None:
    """The Response carries exactly what the chat choice carries."""
    ours, theirs = extra(response), chat_choice.model_extra
    assert ours["token_ids"] == theirs["token_ids"] and len(ours["token_ids"]) >= 1
    assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
    assert [e["token"] for e in ours["logprobs"]["content"]] == [e.token for e in chat_choice.logprobs.content]
    assert [e["logprob"] for e in ours["logprobs"]["content"]] == pytest.approx(
        [e.logprob for e in chat_choice.logprobs.content], abs=1e-4)
    assert ours["step"] == 0
    assert response.status == ("incomplete" if chat_choice.finish_reason == "length" else "completed")
    assert response.usage.input_tokens == len(ours["prompt_token_ids"])
    assert response.usage.output_tokens == len(ours["token_ids"])


def test_text_response_is_the_chat_answer(client):
    response = client.responses.create(
        model=MODEL, instructions="Answer briefly.", max_output_tokens=6, extra_body={"seed": 7},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}])
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, seed=7,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}])
    choice = chat.choices[0]
    assert_same_sample(response, choice)
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == choice.message.content
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 6
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_stream_events_add_up_to_the_whole_response(client):
    ask = {"model": MODEL, "input": "Count to three.", "max_output_tokens": 8, "temperature": 0.0,
           "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))

    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and deltas
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == whole.output_text
    # Logprobs asked for: each delta carries its tokens', and they add up to the whole answer's.
    streamed_lp = [lp.logprob for e in deltas for lp in e.logprobs]
    assert streamed_lp == pytest.approx([lp.logprob for lp in whole.output[0].content[0].logprobs], abs=1e-4)
    final = events[-1].response
    assert extra(final)["token_ids"] == extra(whole)["token_ids"]
    assert extra(final)["prompt_token_ids"] == extra(whole)["prompt_token_ids"]
    assert final.output[0].id == events[2].item.id == deltas[0].item_id
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status
    # Greedy is the same on the chat route.
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to three."}],
                                          max_tokens=8, temperature=0.0)
    assert_same_sample(whole, chat.choices[0])


def test_forced_function_call_round_trip(client):
    ask = {"model": MODEL, "tools": [PICK], "tool_choice": "required", "max_output_tokens": 40}
    question = [{"role": "user", "content": "Pick a letter."}]
    response = client.responses.create(input=question, extra_body={"seed": 3}, **ask)
    [call] = response.output
    assert call.type == "function_call" and call.name == "pick" and call.status == "completed"
    assert json.loads(call.arguments)["x"] in ("a", "b") and call.call_id.startswith("call_")
    assert response.status == "completed" and response.tools[0].name == "pick"
    chat = client.chat.completions.create(model=MODEL, messages=question, tools=[CHAT_PICK], tool_choice="required",
                                          max_tokens=40, seed=3)
    assert_same_sample(response, chat.choices[0])
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments

    # The next turn, as the Agents SDK sends it: the output items back, then the tool's result.
    turn = [*question, *[item.model_dump(exclude_unset=True) for item in response.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "picked"}]
    named = client.responses.create(input=turn, extra_body={"seed": 4},
                                    **{**ask, "tool_choice": {"type": "function", "name": "pick"}})
    messages = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "pick", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "picked"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_PICK], max_tokens=40, seed=4,
                                          tool_choice={"type": "function", "function": {"name": "pick"}})
    assert_same_sample(named, chat.choices[0])
    # The sampled call is written back exactly: the second prompt extends the first prompt and answer.
    first = extra(response)["prompt_token_ids"] + extra(response)["token_ids"]
    assert extra(named)["prompt_token_ids"][:len(first)] == first


def test_streamed_function_call(client):
    events = list(client.responses.create(model=MODEL, input="Pick one.", tools=[PICK], tool_choice="required",
                                          max_output_tokens=40, stream=True, extra_body={"seed": 5}))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, delta, done, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert delta.delta == done.arguments == item_done.item.arguments == completed.response.output[0].arguments
    assert done.name == "pick" and json.loads(done.arguments)["x"] in ("a", "b")
    assert added.item.id == delta.item_id == completed.response.output[0].id
    whole = client.responses.create(model=MODEL, input="Pick one.", tools=[PICK], tool_choice="required",
                                    max_output_tokens=40, extra_body={"seed": 5})
    assert extra(completed.response)["token_ids"] == extra(whole)["token_ids"]
    assert whole.output[0].arguments == done.arguments


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Is zero even?", max_output_tokens=30,
                                       text={"format": {"type": "json_schema", "name": "verdict", "schema": schema,
                                                        "strict": True}})
    assert json.loads(response.output_text)["answer"] in ("yes", "no")
    assert response.text.format.type == "json_schema"


BAD = [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [7]}, "input[0]"),
    ({"input": [{"type": "input_image", "image_url": "https://x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "function_call", "name": "pick", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": "x", "tools": [{**PICK, "parameters": "no"}]}, "tools[0].parameters"),
    ({"input": "x", "tools": [PICK], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tools": [PICK], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": 0}, "top_p"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "input"),  # does not fit the context: the prompt is named
    ({"input": "x", "truncation": "middle"}, "truncation"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, **body)
    assert bad.value.param == param, bad.value.message


def test_malformed_bodies_are_never_500s(server):
    bodies = [{"model": MODEL}, {"model": MODEL, "input": [{"type": "function_call"}]},
              {"model": MODEL, "input": "x", "tools": "all"}, {"model": MODEL, "input": "x", "tool_choice": 5},
              {"model": MODEL, "input": "x", "text": {"format": "json"}}, {"model": MODEL, "input": "x", "text": 1},
              {"model": MODEL, "input": [{"role": "user", "content": None}]}, [1, 2],
              {"model": MODEL, "input": [{"role": "assistant", "content": [None]}]}]
    for body in bodies:
        answer = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(server.base_url + "/v1/responses", json={"model": "nope", "input": "x"}, timeout=30)
    assert missing.status_code == 404
