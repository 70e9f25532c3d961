"""POST /v1/completions (OpenAI's legacy Completions) through the official `openai` client against
a tiny random model on a loopback server.

The prompt is the user's text (no chat template), so its ids must be the tokenizer's; every
choice carries its exact `token_ids`, `prompt_token_ids` and logprobs in the Completions shape,
and those logprobs must be the ones the trainer computes from the same ids. A stream must add up
to the same choices, a stop string must say which one stopped the text, and bad input is a 400
naming the field.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from art.engine.base import SampledTokens
from art.server.app import create_app
from art.server.thread import ServerThread
from tests.support.registry import SingleModelRegistry

pytestmark = pytest.mark.integration

MODEL = "tiny"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def loaded(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    return tokenizer, AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return loaded[0]


@pytest.fixture(scope="module")
def server(loaded):
    from art.engine.llm_engine import LLMEngine

    tokenizer, model = loaded
    with ServerThread(create_app(SingleModelRegistry(LLMEngine(model, tokenizer), MODEL))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def create(client, **kwargs):
    return client.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 6, **kwargs})


def extra(choice) -> dict:
    return choice.model_extra or {}


def trainer_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """What the trainer computes for the completion's tokens: one forward pass, temperature 1."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()  # [tokens, vocab]
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # [completion, vocab]
    return logprobs[torch.arange(len(completion)), torch.tensor(completion)].tolist()


def test_choice_carries_the_ids_and_logprobs_the_trainer_uses(client, loaded):
    tokenizer, model = loaded
    response = create(client, seed=7, logprobs=2)
    [choice] = response.choices
    prompt, ids = extra(choice)["prompt_token_ids"], extra(choice)["token_ids"]
    assert prompt == tokenizer(PROMPT)["input_ids"] == response.model_extra["prompt_token_ids"]
    assert len(ids) == response.usage.completion_tokens == 6 and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt) and response.model_extra["step"] == 0
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx(trainer_logprobs(model, prompt, ids), abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(ids))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= 3
    # Without `logprobs` the sampled tokens' logprobs still come (training needs them); no alternatives.
    plain = create(client, seed=7).choices[0]
    assert extra(plain)["token_ids"] == ids and plain.logprobs.top_logprobs is None
    assert plain.logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_token_id_prompts_and_batches(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    as_text = create(client, seed=5).choices[0]
    as_ids = create(client, seed=5, prompt=ids, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert extra(as_ids)["prompt_token_ids"] == ids and extra(as_ids)["token_ids"] == extra(as_text)["token_ids"]
    assert as_ids.logprobs.tokens == [f"token_id:{t}" for t in extra(as_ids)["token_ids"]]

    other = tokenizer("Once upon a time")["input_ids"]
    batch = create(client, prompt=[ids, other], n=2, temperature=0, max_tokens=3)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [extra(c)["prompt_token_ids"] for c in batch.choices] == [ids, ids, other, other]
    assert extra(batch.choices[0])["token_ids"] == extra(batch.choices[1])["token_ids"]  # greedy
    assert batch.usage.prompt_tokens == len(ids) + len(other) and batch.usage.completion_tokens == 12
    assert "prompt_token_ids" not in batch.model_extra  # a batch has no single prompt
    streamed: dict[int, list[int]] = {}
    for chunk in create(client, prompt=[ids, other], n=2, temperature=0, max_tokens=3, stream=True):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(extra(c).get("token_ids") or [])
    assert streamed == {c.index: extra(c)["token_ids"] for c in batch.choices}
    texts = create(client, prompt=[PROMPT, "Once upon a time"], temperature=0, max_tokens=3)
    assert [extra(c)["token_ids"] for c in texts.choices] == [extra(batch.choices[0])["token_ids"],
                                                             extra(batch.choices[2])["token_ids"]]


def test_stop_string_is_named_and_its_ids_kept(client, tokenizer):
    full = create(client, seed=3, max_tokens=16).choices[0]
    ids = extra(full)["token_ids"]
    stop = next(t for t in (tokenizer.decode([i]) for i in ids[2:]) if t.strip() and "\ufffd" not in t)
    cut = create(client, seed=3, max_tokens=16, stop=["never there", stop]).choices[0]
    assert cut.finish_reason == "stop" and extra(cut)["stop_reason"] == stop
    assert cut.text == full.text[:full.text.find(stop)]
    # The ids end with the stop string's tokens: the text is cut, what was sampled is not.
    assert tokenizer.decode(extra(cut)["token_ids"], skip_special_tokens=True).startswith(cut.text + stop)
    assert extra(cut)["token_ids"] == ids[:len(extra(cut)["token_ids"])]
    assert extra(full)["stop_reason"] is None


def test_stream_adds_up_to_the_whole_response(client):
    ask = {"n": 2, "temperature": 0.0, "logprobs": 1, "max_tokens": 8}
    whole = create(client, **ask)
    stream = create(client, **ask, stream=True, stream_options={"include_usage": True})
    texts, ids, tokens, offsets, logprobs, finish, usage, prompts = {}, {}, {}, {}, {}, {}, None, {}
    for chunk in stream:
        assert chunk.object == "text_completion" and chunk.model_extra["step"] == 0
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(extra(c).get("token_ids") or [])
            if "prompt_token_ids" in extra(c):
                prompts[c.index] = extra(c)["prompt_token_ids"]
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
                logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in whole.choices:
        assert texts[c.index] == c.text and ids[c.index] == extra(c)["token_ids"]
        assert prompts[c.index] == extra(c)["prompt_token_ids"] and finish[c.index] == c.finish_reason
        assert tokens[c.index] == c.logprobs.tokens and offsets[c.index] == c.logprobs.text_offset
        assert logprobs[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_echo_puts_the_prompt_before_the_text(client):
    plain = create(client, seed=9).choices[0]
    echoed = create(client, seed=9, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text and echoed.logprobs is None
    assert extra(echoed)["token_ids"] == extra(plain)["token_ids"]
    streamed = "".join(c.text for chunk in create(client, seed=9, echo=True, stream=True) for c in chunk.choices)
    assert streamed == echoed.text


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], "mixed"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ["a"] * 3, "n": 50}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 5}, "temperature"),
    ({"suffix": "end"}, "suffix"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_bad_input_is_a_400_naming_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as bad:
        create(client, **kwargs)
    assert bad.value.param == field and field in bad.value.message


def test_context_and_model_errors_and_the_server_survives(client, server):
    with pytest.raises(openai.BadRequestError) as long:
        create(client, max_tokens=100_000)
    assert long.value.code == "context_length_exceeded" and long.value.param == "prompt"
    with pytest.raises(openai.NotFoundError):
        create(client, model="nope")
    raw = httpx.post(server.base_url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    missing = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    assert extra(create(client, max_tokens=1).choices[0])["token_ids"]
    assert json.loads(httpx.get(server.base_url + "/health").text)["status"] == "ok"


WRONG = [None, True, -1, 0, 1e300, "", "x", [], [1, "a"], [[]], {}, [{"type": "text"}]]
"""Values of every JSON kind, for every field: none may get a 5xx."""


def test_no_field_value_gets_a_5xx(server):
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logprobs": 1, "stop": ["\n"], "n": 1, "seed": 1,
            "temperature": 0.5, "top_p": 0.9, "echo": False, "stream": False, "stream_options": None,
            "best_of": None, "return_tokens_as_token_ids": False, "add_special_tokens": True, "user": "u"}
    statuses = set()
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for field in base:
            for value in WRONG:
                body = {**base, field: value}
                response = http.post("/v1/completions", json=body)
                assert response.status_code < 500, (body, response.text)
                if response.status_code >= 400:
                    assert response.json()["error"]["param"], (body, response.text)
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
        yield SampledTokens(0, [prompt_token_ids[0]], [-1.0])
        raise RuntimeError("boom")


async def test_engine_failures_are_500s_or_a_stream_error_without_the_exception(tokenizer):
    with ServerThread(create_app(SingleModelRegistry(FailingEngine(tokenizer), MODEL))) as failing:
        async with openai.AsyncOpenAI(base_url=failing.base_url + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.InternalServerError) as failed:
                await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
            assert "boom" not in str(failed.value.body) and failed.value.code == "internal_error"
            texts = []
            with pytest.raises(openai.APIError) as mid:
                async for chunk in await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                                   stream=True):
                    texts += [c.text for c in chunk.choices]
            assert texts and "boom" not in str(mid.value)
