"""Tool calls: the Hermes `<tool_call>` parser, prompt rendering with SmolLM2's real chat
template (which knows no tools), the app's choice shaping, and a request through the official
`openai` client. The tiny random model never emits a tool call, so the parsed-call path is
tested on hand-made completions at the function level.
"""

from __future__ import annotations

import copy
import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from art.chat_template import template_info, template_messages, tool_preamble
from art.engine.base import Completion, all_tokens
from art.server.app import create_app
from art.server.openai_format import ChunkWriter, TokenText, parse_tool_calls, response_choice
from art.server.openai_schemas import ChatCompletionRequest
from art.server.thread import ServerThread
from tests.support.registry import SingleModelRegistry

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def call(name: str, arguments: dict) -> dict:
    return {"name": name, "arguments": json.dumps(arguments)}


def functions(calls: list[dict]) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]


# -- parse_tool_calls ------------------------------------------------------------------------


def test_parse_single_call():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert content is None
    assert len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_parse_several_calls_with_text_around():
    text = (
        "I will look both up.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        "Back soon."
    )
    content, calls = parse_tool_calls(text)
    assert content == "I will look both up.\n\n\nBack soon."
    assert functions(calls) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
    ]
    assert len({c["id"] for c in calls}) == 2


def test_parse_arguments_as_object_or_json_string():
    as_object = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1, "b": "é"}}</tool_call>')[1]
    as_string = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1, \\"b\\": \\"é\\"}"}</tool_call>')[1]
    assert as_object[0]["function"]["arguments"] == as_string[0]["function"]["arguments"] == '{"a": 1, "b": "é"}'
    # No arguments at all is a call without arguments.
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')[1][0]["function"]["arguments"] == "{}"


def test_parse_fences_and_whitespace():
    text = '<tool_call>\n  ```json\n{"name": "f", "arguments": {}}\n```  \n</tool_call>'
    assert functions(parse_tool_calls(text)[1]) == [{"name": "f", "arguments": {}}]


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # malformed JSON
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # missing name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "{not json"}</tool_call>',  # arguments string not JSON
        '<tool_call>["f", {}]</tool_call>',  # not an object
        '<tool_call>\n{"name": "f", "argum',  # cut off inside the JSON
    ],
)
def test_malformed_block_stays_content(block):
    text = f"Before. {block} After."
    assert parse_tool_calls(text) == (text, [])


def test_malformed_block_beside_a_good_one():
    bad = '<tool_call>{"name": "f", "arguments": {oops}}</tool_call>'
    content, calls = parse_tool_calls(f'{bad}\n<tool_call>{{"name": "g", "arguments": {{}}}}</tool_call>')
    assert content == bad and functions(calls) == [{"name": "g", "arguments": {}}]


def test_unterminated_last_block_with_complete_json():
    content, calls = parse_tool_calls('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n')
    assert content == "Sure." and functions(calls) == [{"name": "f", "arguments": {"x": [1, 2]}}]


def test_unclosed_block_before_another_stays_content():
    text = '<tool_call>{"name": "f", "arguments": {}}\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == '<tool_call>{"name": "f", "arguments": {}}'
    assert functions(calls) == [{"name": "g", "arguments": {}}]


@pytest.mark.parametrize(
    "text", ["", "plain text", "<tool_call>", "</tool_call><tool_call>", "<tool_call>" + "[" * 100_000]
)
def test_parse_never_raises(text):
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == (text.strip() or None)


# -- prompt rendering ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def render(tokenizer, messages, tools=None, tool_choice=None) -> str:
    body = ChatCompletionRequest(model=MODEL, messages=messages, tools=tools, tool_choice=tool_choice)
    out, template_tools = template_messages(
        tokenizer, [m.for_template() for m in body.messages], body.tools, body.tool_choice
    )
    return tokenizer.apply_chat_template(out, tools=template_tools, tokenize=False, add_generation_prompt=True)


def system_turn(text: str) -> str:
    assert text.startswith("<|im_start|>system\n")
    return text[len("<|im_start|>system\n"): text.index("<|im_end|>")]


def test_smollm2_template_knows_no_tools(tokenizer):
    info = template_info(tokenizer)
    assert not info.supports_tools
    assert info.tool_role == "tool"  # it renders any role as <|im_start|>{role}


def test_preamble_joins_the_system_turn(tokenizer):
    system = system_turn(render(tokenizer, [{"role": "system", "content": "Be brief."}, *ASK], TOOLS))
    assert system.startswith(tool_preamble(TOOLS))  # prepended to the user's system prompt
    assert system.endswith("\n\nBe brief.")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system
    assert '<tool_call>\n{"name": ' in system

    # Without a system message one is added (instead of the template's default one).
    text = render(tokenizer, ASK, TOOLS)
    assert system_turn(text) == tool_preamble(TOOLS)
    assert "SmolLM" not in text and text.count("<|im_start|>system") == 1


def test_history_renders_tool_calls_and_responses(tokenizer):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": call("get_weather", {"city": "Paris"})},
            {"id": "call_2", "type": "function", "function": call("get_weather", {"city": "Oslo"})},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "snow"},
    ]
    text = render(tokenizer, messages, TOOLS)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert "<|im_start|>tool\n<tool_response>\nsnow\n</tool_response><|im_end|>\n" in text
    # Content beside the calls comes first.
    messages[1] = {**messages[1], "content": "Checking."}
    assert "<|im_start|>assistant\nChecking.\n<tool_call>\n" in render(tokenizer, messages, TOOLS)


def test_tool_choice_none_leaves_the_prompt_as_without_tools(tokenizer):
    assert render(tokenizer, ASK, TOOLS, "none") == render(tokenizer, ASK)
    assert render(tokenizer, ASK) == tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    # "required" and a named function are asked of the model the same way as "auto".
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert render(tokenizer, ASK, TOOLS, "required") == render(tokenizer, ASK, TOOLS, named) == render(tokenizer, ASK, TOOLS)


def test_template_without_a_tool_role_gets_results_as_one_user_turn(tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    assert template_info(strict).tool_role == "user"
    messages = [
        *ASK,
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": call("get_weather", {"city": "Paris"})}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        {"role": "tool", "tool_call_id": "d", "content": "warm"},
    ]
    text = render(strict, messages, TOOLS)
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>" in text


def test_tool_aware_template_renders_tools_itself(tokenizer):
    aware = copy.deepcopy(tokenizer)
    aware.chat_template = (
        "{% if tools %}{{ 'TOOLS ' + (tools | tojson) + '\n' }}{% endif %}"
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    )
    assert template_info(aware).supports_tools
    assert render(aware, ASK, TOOLS).startswith("TOOLS [")
    assert "<tools>" not in render(aware, ASK, TOOLS)
    assert render(aware, ASK, TOOLS, "none") == "user: Weather in Paris?\n"


# -- choice shaping (function level) ---------------------------------------------------------


def completion(tokenizer, text: str, finish: str = "stop") -> Completion:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Completion(ids, [-0.25] * len(ids), text, finish)


def test_choice_with_a_tool_call(tokenizer):
    c = completion(tokenizer, CALL_TEXT)
    ids = list(c.token_ids)
    choice = response_choice(0, c, [1, 2, 3], TokenText(tokenizer), parse_tools=True)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["token_ids"] == ids and choice["prompt_token_ids"] == [1, 2, 3]
    assert len(choice["logprobs"]["content"]) == len(ids)
    parsed = ChatCompletion.model_validate(
        {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [choice]}
    ).choices[0]
    assert parsed.message.content == "Let me check."
    (tool_call,) = parsed.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert parsed.model_extra["token_ids"] == ids


def test_choice_without_parsing_or_with_malformed_calls(tokenizer):
    c = completion(tokenizer, CALL_TEXT, "length")
    plain = response_choice(0, c, [1], TokenText(tokenizer), parse_tools=False)  # tool_choice "none"
    assert plain["message"] == {"role": "assistant", "content": CALL_TEXT}
    assert plain["finish_reason"] == "length"
    broken = CALL_TEXT.replace('"Paris"}', '"Paris"')
    bad = response_choice(0, completion(tokenizer, broken), [1], TokenText(tokenizer), parse_tools=True)
    assert bad["message"] == {"role": "assistant", "content": broken} and bad["finish_reason"] == "stop"


def sse_of(head, prompt, completions, tokens: TokenText, parse_tools: bool) -> list[str]:
    """The whole SSE stream of completions already sampled, as the server writes it."""
    writer = ChunkWriter(head, prompt, len(completions), tokens, (), parse_tools, False,
                         finals=[c.text for c in completions])
    return [writer.start(), *(chunk for sampled in all_tokens(completions) for chunk in writer.sampled(sampled)),
            *writer.finish(completions, {})]


def test_stream_chunks_with_a_tool_call(tokenizer):
    c = completion(tokenizer, CALL_TEXT)
    head = {"id": "chatcmpl-x", "created": 0, "model": MODEL}
    sse = sse_of(head, [1, 2], [c], TokenText(tokenizer), True)
    assert sse[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(s[len("data: "):])) for s in sse[:-1]]
    ids = [i for ch in chunks for x in ch.choices for i in (x.model_extra or {}).get("token_ids") or []]
    assert ids == c.token_ids  # every sampled id still streams, with its logprob
    assert sum(len(x.logprobs.content) for ch in chunks for x in ch.choices if x.logprobs) == len(ids)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.content == "Let me check."
    (tool_call,) = final.message.tool_calls
    assert tool_call.function.name == "get_weather" and tool_call.id.startswith("call_")
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}


# -- through the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from art.engine.llm_engine import LLMEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with ServerThread(create_app(SingleModelRegistry(LLMEngine(model, tokenizer), MODEL))) as server:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as c:
            yield c


@pytest.mark.integration
def test_server_prompt_has_the_preamble_and_returns_ids(client, tokenizer):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=6, seed=0)
    prompt = response.model_extra["prompt_token_ids"]
    expected = tokenizer.encode(render(tokenizer, ASK, TOOLS), add_special_tokens=False)
    assert prompt == expected
    assert tool_preamble(TOOLS) in tokenizer.decode(prompt)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])

    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert plain.model_extra["prompt_token_ids"] == tokenizer.apply_chat_template(ASK, add_generation_prompt=True)["input_ids"]


@pytest.mark.integration
def test_server_takes_a_tool_conversation_and_streams(client, tokenizer):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": call("get_weather", {"city": "Paris"})}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, stream=True)
    ids, prompt = [], None
    for chunk in stream:
        prompt = prompt or chunk.model_extra.get("prompt_token_ids")
        ids += [i for c in chunk.choices for i in (c.model_extra or {}).get("token_ids") or []]
    assert len(ids) in range(1, 5)  # at least one token, at most max_tokens
    assert "<tool_response>\nsunny\n</tool_response>" in tokenizer.decode(prompt)


@pytest.mark.integration
def test_server_rejects_bad_tool_requests(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="sometimes")
    assert bad.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert unknown.value.param == "tool_choice" and "nope" in str(unknown.value)
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[{"type": "function", "function": {}}])
    assert tools.value.param == "tools"
