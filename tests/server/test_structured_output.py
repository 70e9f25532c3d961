"""Structured outputs: grammar-constrained sampling in the engine and through the server.

The tiny random model, left free, never writes JSON; under a grammar every completion must
parse, every token must be one the grammar allowed, and the engine must still agree token for
token with the reference sampler (greedy and seeded), reporting the raw, unmasked logprobs.
"""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from art.engine.base import SamplingParams
from art.engine.llm_engine import LLMEngine
from art.engine.reference import ReferenceSampler
from art.server.app import create_app
from art.server.structured_output import grammar_for
from art.server.thread import ServerThread
from tests.support.registry import SingleModelRegistry

MODEL = "tiny"
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["answer", "count", "note"],
    "additionalProperties": False,
}
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Is it raining? Answer in JSON."}]


def follows_answer_schema(text: str) -> bool:
    data = json.loads(text)
    return (set(data) == {"answer", "count", "note"} and data["answer"] in ("yes", "no", "maybe")
            and isinstance(data["count"], int) and 0 <= data["count"] <= 99
            and isinstance(data["note"], str) and len(data["note"]) <= 6)


@pytest.fixture(scope="module")
def setup(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = LLMEngine(model, tokenizer)
    yield model, tokenizer, engine
    engine.stop()


def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7)], ids=["greedy", "seeded"])
async def test_constrained_sampling_follows_the_grammar_and_matches_the_reference(setup, temperature, seed):
    model, tokenizer, engine = setup
    grammar = grammar_for({"type": "json_schema", "json_schema": {"schema": ANSWER}}, None, None)
    params = SamplingParams(n=3, temperature=temperature, seed=seed, max_tokens=48, grammar=grammar)
    prompt = prompt_ids(tokenizer)
    ours = await engine.generate(prompt, params, None)
    reference = ReferenceSampler(model, tokenizer).generate(prompt, params, None)
    for completion, expected in zip(ours, reference):
        assert completion.token_ids == expected.token_ids
        assert completion.text == expected.text
        assert completion.finish_reason == "stop" and completion.token_ids[-1] == tokenizer.eos_token_id
        assert follows_answer_schema(completion.text), completion.text
        # Every sampled token was allowed by the grammar at its position.
        matcher = engine.grammars.matcher(grammar)
        for token in completion.token_ids:
            assert engine.grammars.allowed([matcher])[0, token]
            matcher.consume_token(token)
        # The reported logprobs are the model's raw ones, not the masked distribution's.
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.token_ids])).logits[0].float()
        raw = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        expected_logprobs = raw.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(completion.logprobs), expected_logprobs, atol=1e-4)
    if temperature == 0:
        assert len({tuple(c.token_ids) for c in ours}) == 1
    # The same engine still samples free text for a request without a grammar.
    free = await engine.generate(prompt, SamplingParams(n=1, temperature=0.0, max_tokens=8), None)
    assert free[0].token_ids == ReferenceSampler(model, tokenizer).generate(
        prompt, SamplingParams(n=1, temperature=0.0, max_tokens=8), None)[0].token_ids


async def test_constrained_and_free_rows_share_a_batch(setup):
    _, tokenizer, engine = setup
    grammar = grammar_for({"type": "json_object"}, None, None)
    prompt = prompt_ids(tokenizer)
    constrained, free = await asyncio.gather(
        engine.generate(prompt, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=400, grammar=grammar), None),
        engine.generate(prompt, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=16), None),
    )
    for completion in constrained:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # a random model may write a long object; what it wrote is a JSON prefix
            assert completion.text.startswith("{")
    assert not any(c.text.startswith("{") and c.text.endswith("}") for c in free)


@pytest.fixture(scope="module")
def client(setup):
    _, _, engine = setup
    with ServerThread(create_app(SingleModelRegistry(engine, MODEL))) as server:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as c:
            yield c


@pytest.mark.integration
def test_response_format_json_schema_through_the_openai_client(client):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, n=8, temperature=1.0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
    assert len(response.choices) == 8
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert follows_answer_schema(choice.message.content), choice.message.content
        assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])


@pytest.mark.integration
@pytest.mark.parametrize("tool_choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
], ids=["required", "named"])
def test_forced_tool_calls(client, tool_choice, names):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=[CITY, CLOCK], n=6,
                                              tool_choice=tool_choice, temperature=1.0, max_tokens=40, seed=3)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        [call] = choice.message.tool_calls  # one call: parallel_tool_calls was not asked for
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        assert arguments in ({"city": "Paris"}, {"city": "Rome"}, {"zone": "UTC"}, {"zone": "CET"})


@pytest.mark.integration
def test_a_forced_call_wins_over_response_format(client):
    """OpenAI takes both (the Agents SDK sends an agent's output_type with tool_choice="required"):
    the forced turn's completion is the call, response_format shapes text answers only."""
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CITY], tool_choice="required", max_tokens=40, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert json.loads(choice.message.tool_calls[0].function.arguments) in ({"city": "Paris"}, {"city": "Rome"})


@pytest.mark.integration
@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_response_formats_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
    assert bad.value.param == param


@pytest.mark.integration
@pytest.mark.parametrize("extra,follows", [
    ({"guided_json": ANSWER}, follows_answer_schema),
    ({"guided_json": json.dumps(ANSWER)}, follows_answer_schema),
    ({"structured_outputs": {"json": ANSWER}}, follows_answer_schema),
    # Any object: the random model's free strings run past max_tokens, so only the start is checked.
    ({"structured_outputs": {"json_object": True}}, lambda text: text == "{}" or text.startswith('{"')),
    ({"guided_choice": ["yes", "no", "it depends"]}, lambda text: text in ("yes", "no", "it depends")),
    ({"structured_outputs": {"choice": ["Paris", "Rome"]}}, lambda text: text in ("Paris", "Rome")),
    ({"guided_regex": r"[0-9]{3}-[a-c]{2}/x"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-c]{2}/x", text)),
    ({"structured_outputs": {"grammar": 'start: "A" ("b" | "c")+ "."'}},
     lambda text: re.fullmatch(r"A[bc]+\.", text)),
], ids=["guided_json", "guided_json-text", "structured_outputs-json", "json_object", "guided_choice",
        "structured_outputs-choice", "guided_regex", "structured_outputs-grammar"])
def test_vllm_constraints_through_the_openai_client(client, extra, follows):
    """vLLM's guided decoding fields, as the official client sends them (`extra_body`)."""
    response = client.chat.completions.create(model=MODEL, messages=ASK, n=6, temperature=1.0, max_tokens=48,
                                              seed=2, extra_body=extra)
    for choice in response.choices:
        assert choice.finish_reason == "stop" or "json_object" in str(extra), choice.message.content
        assert follows(choice.message.content), choice.message.content


@pytest.mark.integration
@pytest.mark.parametrize("extra,param", [
    ({"guided_json": ANSWER, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"structured_outputs": {"regex": "a+"}, "tools": [CITY], "tool_choice": "required"},
     "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
])
def test_bad_vllm_constraints_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert bad.value.param == param, bad.value.message
