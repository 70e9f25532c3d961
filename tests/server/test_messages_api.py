"""POST /v1/messages (Anthropic's Messages API) through the official `anthropic` client against a
tiny random model on a loopback server.

A Messages request is served as the chat request it means, so the same seeded (or greedy) chat
request must sample exactly the same ids from exactly the same prompt; the `Message` carries them
at its top level (`token_ids`, `prompt_token_ids`, `logprobs`, `step`), and a stream carries them
on `message_start` and `message_delta`. Tool calls are forced by `tool_choice` (a random model
never calls on its own) and sent back as an Anthropic agent sends them; bad input is a 4xx in
Anthropic's error shape naming the field.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from art.engine.base import SampledTokens
from art.server.app import create_app
from art.server.security import BearerAuth
from art.server.thread import ServerThread
from tests.support.registry import SingleModelRegistry

pytestmark = pytest.mark.integration

MODEL = "tiny"
KEY = "messages-key-1"
PICK = {"name": "pick", "description": "Pick a letter.",
        "input_schema": {"type": "object", "properties": {"x": {"type": "string", "enum": ["a", "b"]}},
                         "required": ["x"], "additionalProperties": False}}
CHAT_PICK = {"type": "function", "function": {"name": "pick", "description": "Pick a letter.",
                                              "parameters": PICK["input_schema"]}}
HI = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def server(tiny_model_path, tokenizer):
    """The app behind the API key (the `anthropic` SDK sends it as `x-api-key`)."""
    from transformers import AutoModelForCausalLM

    from art.engine.llm_engine import LLMEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    app = create_app(SingleModelRegistry(LLMEngine(model, tokenizer), MODEL))
    with ServerThread(BearerAuth(app, api_key=KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def chat(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def create(client, **kwargs):
    return client.messages.create(**{"model": MODEL, "max_tokens": 6, "messages": HI, **kwargs})


def extra(obj) -> dict:
    return obj.model_extra or {}


def assert_same_sample(message, chat_choice) -> None:
    """The Message carries exactly what the chat choice carries."""
    ours, theirs = extra(message), chat_choice.model_extra
    assert ours["token_ids"] == theirs["token_ids"] and len(ours["token_ids"]) >= 1
    assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
    assert ours["logprobs"] == pytest.approx([e.logprob for e in chat_choice.logprobs.content], abs=1e-4)
    assert ours["step"] == 0
    expected = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}[chat_choice.finish_reason]
    assert message.stop_reason == expected
    assert message.usage.input_tokens == len(ours["prompt_token_ids"])
    assert message.usage.output_tokens == len(ours["token_ids"])


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_message_is_the_chat_answer(client, chat):
    message = create(client, system=[{"type": "text", "text": "Answer briefly."}], extra_body={"seed": 7})
    reply = chat.chat.completions.create(model=MODEL, max_tokens=6, seed=7, messages=[
        {"role": "system", "content": "Answer briefly."}, *HI])
    choice = reply.choices[0]
    assert_same_sample(message, choice)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_") and text_of(message) == (choice.message.content or "")


def test_stream_adds_up_to_the_whole_message(client):
    ask = {"max_tokens": 8, "system": "Count.", "extra_body": {"temperature": 0.0}}
    whole = create(client, **ask)
    events = list(create(client, **ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(whole) and text
    start, delta = events[0], events[-2]
    assert extra(start.message)["prompt_token_ids"] == extra(whole)["prompt_token_ids"]
    assert extra(delta)["token_ids"] == extra(whole)["token_ids"]
    assert extra(delta)["logprobs"] == pytest.approx(extra(whole)["logprobs"], abs=1e-4)
    assert extra(delta)["prompt_token_ids"] == extra(whole)["prompt_token_ids"] and extra(delta)["step"] == 0
    assert delta.delta.stop_reason == whole.stop_reason and delta.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own accumulator reads the same message.
    with client.messages.stream(model=MODEL, messages=HI, **ask) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason


def test_stop_sequence_is_named(client, tokenizer):
    full = create(client, max_tokens=16, extra_body={"seed": 3})
    ids = extra(full)["token_ids"]
    stop = next(t for t in (tokenizer.decode([i]) for i in ids[2:]) if t.strip() and "\ufffd" not in t)
    cut = create(client, max_tokens=16, stop_sequences=[stop], extra_body={"seed": 3})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == text_of(full)[:text_of(full).find(stop)]
    assert extra(cut)["token_ids"] == ids[:len(extra(cut)["token_ids"])]
    assert full.stop_reason == "max_tokens" and full.stop_sequence is None


def test_tool_use_round_trip(client, chat):
    ask = {"tools": [PICK], "max_tokens": 40}
    message = create(client, tool_choice={"type": "any"}, extra_body={"seed": 3}, **ask)
    [call] = message.content
    assert call.type == "tool_use" and call.name == "pick" and call.input["x"] in ("a", "b")
    assert call.id.startswith("toolu_") and message.stop_reason == "tool_use"
    reply = chat.chat.completions.create(model=MODEL, messages=HI, tools=[CHAT_PICK], tool_choice="required",
                                         max_tokens=40, seed=3)
    assert_same_sample(message, reply.choices[0])
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == call.input

    # The next turn, as an Anthropic agent sends it: the assistant's content back, then the result.
    turn = [*HI, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "picked"}]}]
    named = create(client, messages=turn, tool_choice={"type": "tool", "name": "pick"}, extra_body={"seed": 4}, **ask)
    assert named.content[0].type == "tool_use" and named.stop_reason == "tool_use"
    reply = chat.chat.completions.create(
        model=MODEL, max_tokens=40, seed=4, tools=[CHAT_PICK],
        tool_choice={"type": "function", "function": {"name": "pick"}},
        messages=[*HI, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "pick", "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "picked"}])
    assert_same_sample(named, reply.choices[0])
    # The sampled call is written back exactly: the second prompt extends the first prompt and answer.
    first = extra(message)["prompt_token_ids"] + extra(message)["token_ids"]
    assert extra(named)["prompt_token_ids"][:len(first)] == first

    # Streamed, the call is one tool_use block with its input as one JSON delta.
    events = list(create(client, tool_choice={"type": "any"}, extra_body={"seed": 3}, stream=True, **ask))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.name == "pick"
    [json_delta] = [e.delta for e in events if e.type == "content_block_delta"]
    assert json.loads(json_delta.partial_json) == call.input
    assert events[-2].delta.stop_reason == "tool_use" and extra(events[-2])["token_ids"] == extra(message)["token_ids"]


def test_count_tokens_is_the_prompt_length(client):
    ask = {"system": "Answer briefly.", "tools": [PICK], "messages": HI}
    counted = client.messages.count_tokens(model=MODEL, **ask)
    assert counted.input_tokens == len(extra(create(client, **ask))["prompt_token_ids"])
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert "messages[0].content[0].type" in bad.value.body["error"]["message"]


def test_output_config_constrains_the_text(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    message = create(client, max_tokens=30, output_config={"format": {"type": "json_schema", "schema": schema}},
                     extra_body={"seed": 1})
    assert json.loads(text_of(message))["color"] in ("red", "blue")


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [*HI, {"role": "assistant", "content": "Blue"}]}, "messages[1].role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [PICK], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format.type"),
    ({"extra_body": {"temperature": 5}}, "temperature"),
])
def test_bad_input_is_an_anthropic_400_naming_the_field(client, kwargs, field):
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(client, **kwargs)
    assert bad.value.status_code == 400 and bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error" and field in bad.value.body["error"]["message"]


def test_other_errors_are_anthropic_shaped_and_the_server_survives(client, server):
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(client, model="nope")
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as long:
        create(client, max_tokens=10_000)
    assert "maximum context length is 512 tokens" in long.value.body["error"]["message"]
    url, headers = server.base_url + "/v1/messages", {"x-api-key": KEY, "content-type": "application/json"}
    raw = httpx.post(url, content=b'{"model": "tiny", "messages": [', headers=headers)
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError):
            create(stranger)
    assert extra(create(client, max_tokens=1))["token_ids"]


WRONG = [None, True, -1, 1e300, "", [], [{}], [{"type": "text"}], {}, {"type": "any"},
         [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "x"}]}]}]]
"""Values of every JSON kind, for every field: none may get a 5xx."""


def test_no_field_value_gets_a_5xx(server):
    base = {"model": MODEL, "max_tokens": 1, "messages": HI, "system": "Be brief.", "stop_sequences": ["\n"],
            "temperature": 0.5, "top_p": 0.9, "top_k": 5, "tools": [PICK], "tool_choice": {"type": "auto"},
            "stream": False, "metadata": {}, "seed": 1, "output_config": None, "thinking": None}
    statuses = set()
    with httpx.Client(base_url=server.base_url, timeout=60, headers={"x-api-key": KEY}) as http:
        for field in base:
            for value in WRONG:
                body = {**base, field: value}
                response = http.post("/v1/messages", json=body)
                assert response.status_code < 500, (body, response.text)
                if response.status_code >= 400:
                    assert response.json()["type"] == "error" and response.json()["error"]["message"], body
                statuses.add(response.status_code)
    assert 200 in statuses and statuses <= {200, 400, 404}


class FailingEngine:
    """Fails at once (`generate`) or after its first token (`stream`): what a route sees of a crash."""

    max_model_len = 512

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def generate(self, prompt_token_ids, params, adapter):
        raise RuntimeError("boom")

    async def stream(self, prompt_token_ids, params, adapter):
        yield SampledTokens(0, [self.tokenizer.encode("Hi")[0]], [-1.0])
        raise RuntimeError("boom")


async def test_engine_failures_are_anthropic_errors_without_the_exception(tokenizer):
    with ServerThread(create_app(SingleModelRegistry(FailingEngine(tokenizer), MODEL))) as failing:
        async with anthropic.AsyncAnthropic(base_url=failing.base_url, api_key="x", max_retries=0) as client:
            with pytest.raises(anthropic.InternalServerError) as failed:
                await client.messages.create(model=MODEL, max_tokens=4, messages=HI)
            assert failed.value.body["error"]["type"] == "api_error" and "boom" not in str(failed.value.body)
            assert "request_id" in failed.value.body["error"]["message"]
            # Once the stream has begun, the failure is its last event, which the SDK raises.
            kinds = []
            with pytest.raises(anthropic.APIStatusError) as mid:
                async for event in await client.messages.create(model=MODEL, max_tokens=4, messages=HI, stream=True):
                    kinds.append(event.type)
            assert kinds[0] == "message_start" and "boom" not in str(mid.value.body)
