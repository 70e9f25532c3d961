"""The OpenAI-compatible app over a real loopback socket, driven by the official `openai` client.

The tiny random model makes texts gibberish but token ids, logprobs, seeds and error mapping
are exactly what a real model goes through.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from art.engine.base import Completion
from art.server.app import create_app
from art.server.openai_format import IncrementalText
from art.server.thread import ServerThread
from tests.support.registry import SingleModelRegistry

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def server(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from art.engine.llm_engine import LLMEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    engine = LLMEngine(model, tokenizer)
    with ServerThread(create_app(SingleModelRegistry(engine, MODEL))) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def create(client, **kwargs):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **kwargs}
    return client.chat.completions.create(**args)


@pytest.mark.integration
def test_health_and_models(server, client):
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "art"


@pytest.mark.integration
def test_choices_carry_token_ids_and_logprobs(client, tokenizer):
    response = create(client, n=2, seed=1, max_tokens=12)
    prompt = template_ids(tokenizer, MESSAGES)
    assert response.model == MODEL and response.id.startswith("chatcmpl-")
    assert response.model_extra["prompt_token_ids"] == prompt
    assert response.model_extra["step"] == 0
    assert len(response.choices) == 2
    lengths = 0
    for choice in response.choices:
        ids = choice.model_extra["token_ids"]
        assert choice.model_extra["prompt_token_ids"] == prompt
        entries = choice.logprobs.content  # present although logprobs was not requested
        assert len(entries) == len(ids) >= 1
        for token_id, entry in zip(ids, entries):
            assert entry.token == tokenizer.decode([token_id])
            if "\ufffd" not in entry.token:  # else: the raw bytes of a split character
                assert entry.bytes == list(entry.token.encode("utf-8"))
            assert entry.logprob <= 0 and entry.top_logprobs == []
        if choice.finish_reason == "length":
            lengths += 1
            assert len(ids) == 12
            # The engine's text skips special tokens (EOS and chat markers).
            assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    assert lengths >= 1
    total = sum(len(c.model_extra["token_ids"]) for c in response.choices)
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == total


@pytest.mark.integration
def test_n_choices(client):
    response = create(client, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]


@pytest.mark.integration
def test_seed_reproducible(client):
    a, b = (create(client, n=2, seed=1234, temperature=1.0) for _ in range(2))
    ids = lambda r: [c.model_extra["token_ids"] for c in r.choices]  # noqa: E731
    assert ids(a) == ids(b)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


@pytest.mark.integration
def test_greedy_deterministic(client):
    a, b = (create(client, temperature=0) for _ in range(2))
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


@pytest.mark.integration
def test_stop_cuts_text(client, tokenizer):
    # The same seed samples the same tokens, so the second run is the first one cut short.
    full = create(client, seed=3, max_tokens=16).choices[0]
    ids = full.model_extra["token_ids"]
    # A stop string taken from inside the sampled text (a later token's text).
    stop = next(t for t in (tokenizer.decode([i]) for i in ids[2:]) if t.strip() and "\ufffd" not in t)
    cut = create(client, seed=3, max_tokens=16, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full.message.content[: full.message.content.find(stop)]
    assert stop not in cut.message.content


@pytest.mark.integration
def test_top_logprobs(client):
    choice = create(client, temperature=0, logprobs=True, top_logprobs=3).choices[0]
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one, with the same logprob.
        assert entry.top_logprobs[0].token == entry.token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.integration
def test_vllm_truncations_reach_the_sampler(client):
    # vLLM's top_k and min_p, sent as the official client sends extras: every sampled token is
    # within the top 2 (top_k=2) or the most likely one (min_p=1, the greedy answer).
    choice = create(client, n=4, seed=5, temperature=1.5, logprobs=True, top_logprobs=2, max_tokens=12,
                    extra_body={"top_k": 2}).choices
    for c in choice:
        for entry in c.logprobs.content:
            assert entry.token in [alt.token for alt in entry.top_logprobs]
    greedy = create(client, temperature=0).choices[0].model_extra["token_ids"]
    only_top = create(client, seed=5, temperature=1.5, extra_body={"min_p": 1.0}).choices[0]
    assert only_top.model_extra["token_ids"] == greedy


@pytest.mark.integration
async def test_stream_matches_non_stream(server):
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as ac:
        args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "n": 2, "seed": 7}
        whole = await ac.chat.completions.create(**args)
        stream = await ac.chat.completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
        texts, ids, finish, usage, prompt = {}, {}, {}, None, None
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if prompt is None:
                prompt = chunk.model_extra["prompt_token_ids"]
                assert all(c.delta.role == "assistant" for c in chunk.choices)
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                ids.setdefault(c.index, []).extend((c.model_extra or {}).get("token_ids") or [])
                if c.logprobs is not None:
                    assert len(c.logprobs.content) == 1
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
    assert prompt == whole.model_extra["prompt_token_ids"]
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        assert ids[choice.index] == choice.model_extra["token_ids"]
        assert finish[choice.index] == choice.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def _deltas(tokenizer, ids: list[int], text: str) -> list[str]:
    """Per-token deltas of a whole completion, as the stream sends them; the rest rides on the last."""
    incremental = IncrementalText(tokenizer, final=text)
    deltas = [incremental.add(i) for i in ids]
    deltas[-1] += incremental.rest(text)
    return deltas


def test_deltas_keep_multibyte_characters(tokenizer):
    text = "naïve 日本語 emoji 🤖🚀 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _deltas(tokenizer, ids, tokenizer.decode(ids))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    # A stop cut shorter than the decode still concatenates to the cut text.
    assert "".join(_deltas(tokenizer, ids, text[:9])) == text[:9]


@pytest.mark.integration
def test_errors_are_openai_shaped_and_server_survives(server, client):
    with pytest.raises(openai.NotFoundError):
        create(client, model="nope")
    with pytest.raises(openai.BadRequestError) as bad:
        create(client, temperature=5)
    assert "temperature" in str(bad.value) and bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        create(client, messages=[{"role": "user", "content": "hello " * 600}])
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as room:
        create(client, max_tokens=10_000)
    assert room.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="unsupported"):
        create(client, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        create(client, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        create(client, messages=[])
    with pytest.raises(openai.BadRequestError, match="text content parts"):
        create(client, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])

    url = server.base_url + "/v1/chat/completions"
    raw = httpx.post(url, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"})
    assert raw.status_code == 400
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    missing = httpx.post(url, json={"model": MODEL})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    assert httpx.get(server.base_url + "/v1/nothing").status_code == 404

    assert create(client, max_tokens=2).choices[0].model_extra["token_ids"]


class FakeEngine:
    """Returns a fixed completion (or raises), to test the app's shaping without sampling."""

    max_model_len = 512

    def __init__(self, tokenizer, text: str | None):
        self.tokenizer, self.text = tokenizer, text

    async def generate(self, prompt_token_ids, params, adapter):
        if self.text is None:
            raise RuntimeError("boom")
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        return [Completion(ids, [-1.0] * len(ids), self.text, "length")] * params.n


async def test_bytes_rebuild_split_characters(tokenizer):
    text = "hé 🤖 ok"
    app = create_app(SingleModelRegistry(FakeEngine(tokenizer, text), MODEL))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
        entries = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"]["content"]
    assert any("\ufffd" in e["token"] for e in entries)  # the emoji is split across tokens
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == text


async def test_engine_failure_is_a_500_with_a_request_id_not_the_exception(tokenizer, caplog):
    """The body says "internal error" and a request id; the exception (class, message, stack)
    goes only to the server's log line that carries the same id."""
    app = create_app(SingleModelRegistry(FakeEngine(tokenizer, None), MODEL))
    transport = httpx.ASGITransport(app=app)  # raises if an exception escapes the app
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 500
        error = response.json()["error"]
        assert "boom" not in response.text and "RuntimeError" not in response.text
        assert error["code"] == "internal_error" and error["request_id"] in error["message"]
        logged = [r for r in caplog.records if error["request_id"] in r.getMessage()]
        assert logged and "boom" in logged[0].getMessage() and logged[0].exc_info is not None
        assert (await http.get("/health")).json()["status"] == "ok"


@pytest.mark.integration
def test_idle_keep_alive_connection_outlives_the_clients_expiry(server):
    """A connection idle for longer than httpx's 5 s keep-alive expiry is still open: the
    client always drops it first, so no request is sent on a socket the server is closing
    (a rollout right after a long training step failed that way with uvicorn's 5 s default)."""
    import http.client
    import time
    from urllib.parse import urlparse

    url = urlparse(server.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read().startswith(b'{"status"')
        first_socket = connection.sock
        time.sleep(6.0)
        connection.request("GET", "/health")  # on the same socket: a closed one raises here or below
        assert connection.getresponse().read().startswith(b'{"status"')
        assert connection.sock is first_socket
    finally:
        connection.close()


@pytest.mark.integration
def test_chat_template_kwargs_reach_the_template(client, tokenizer):
    """vLLM's `chat_template_kwargs` (ART sends `enable_thinking`) are the template's variables;
    the prompt ids every response reports are the ones rendered with them."""
    original = tokenizer.chat_template
    tokenizer.chat_template = original + (
        "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}")
    try:
        plain = create(client, max_tokens=1).model_extra["prompt_token_ids"]
        thinking_off = create(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                 enable_thinking=False)
        rendered = list(rendered if isinstance(rendered, list) else rendered["input_ids"])
        assert thinking_off.model_extra["prompt_token_ids"] == rendered != plain
        assert tokenizer.decode(rendered[len(plain):]) == "<think>\n\n</think>\n\n"
        with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
            create(client, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    finally:
        tokenizer.chat_template = original
