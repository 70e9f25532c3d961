"""`stream=True` sends each token as the engine samples it, over a real loopback socket to the
official `openai` client: the first chunk leaves long before the last token is sampled, the
stream adds up to the non-streamed answer, /health reports time to first token, and a stopped
engine answers 503 with Retry-After (or, mid-stream, ends the stream with an error event).
"""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from art.engine.llm_engine import TTFT_WINDOW
from art.engine.replicas import ReplicaSet
from art.server.app import create_app
from art.server.thread import ServerThread
from tests.support.registry import SingleModelRegistry

pytestmark = pytest.mark.integration

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell a long story."}]
LONG = 256
"""Tokens of the long streams: about 1-2 s of decoding for the tiny model on a busy 2-core machine."""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def serve(engine):
    """The app over `engine` (an LLMEngine, or a ReplicaSet of it) on a loopback port."""
    return ServerThread(create_app(SingleModelRegistry(engine, MODEL)))


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    from art.engine.llm_engine import LLMEngine

    engine = LLMEngine(model, tokenizer)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(engine):
    with serve(engine) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def long_stream(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=LONG, stream=True, seed=5,
                                          extra_body={"ignore_eos": True}, **kwargs)


def test_first_token_arrives_while_the_rest_is_still_being_sampled(client, engine):
    """Read from the engine's own state, not from the clock: a server that buffered the answer
    would hand over its first token after the engine had sampled all of them."""
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # first-call costs out of the way
    ids, sampled_at_first, while_running = [], None, 0
    for chunk in long_stream(client):
        new = [i for c in chunk.choices for i in (c.model_extra or {}).get("token_ids") or []]
        if not new:
            continue
        if sampled_at_first is None:
            with engine.lock:  # the engine samples nothing while this is held
                rows = list(engine.scheduler.running)
                sampled_at_first = len(rows[0].ids) if rows else LONG
        while_running += engine.running == 1  # a length read, no lock: the engine is not slowed
        ids += new
    assert len(ids) == LONG
    # When the client held its first token, the engine had sampled only the start of the answer.
    assert sampled_at_first < LONG // 2, sampled_at_first
    # Spread out, not one burst at the end: most chunks reached the client while it still decoded.
    assert while_running > LONG // 2, while_running


def collect(stream) -> dict:
    """The streamed answer put together: text, ids, logprobs entries and finish per choice."""
    out = {"choices": {}, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        out.setdefault("prompt_token_ids", chunk.model_extra.get("prompt_token_ids"))
        out["step"] = chunk.model_extra["step"]
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for c in chunk.choices:
            choice = out["choices"].setdefault(c.index, {"text": "", "ids": [], "logprobs": [], "finish": None})
            choice["text"] += c.delta.content or ""
            choice["ids"] += (c.model_extra or {}).get("token_ids") or []
            if c.logprobs is not None:
                assert len(c.logprobs.content) == len((c.model_extra or {}).get("token_ids") or []) == 1
                choice["logprobs"] += c.logprobs.content
            choice["finish"] = c.finish_reason or choice["finish"]
    return out


def assert_same_answer(whole, streamed) -> None:
    assert streamed["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert streamed["step"] == whole.model_extra["step"]
    assert streamed["usage"].completion_tokens == whole.usage.completion_tokens
    assert sorted(streamed["choices"]) == [c.index for c in whole.choices]
    for choice in whole.choices:
        got = streamed["choices"][choice.index]
        assert got["text"] == choice.message.content
        assert got["ids"] == choice.model_extra["token_ids"]
        assert got["finish"] == choice.finish_reason
        assert [e.model_dump() for e in got["logprobs"]] == [e.model_dump() for e in choice.logprobs.content]


def test_stream_adds_up_to_the_non_streamed_answer(client, tokenizer):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "n": 2, "seed": 11, "logprobs": True,
            "top_logprobs": 2}
    whole = client.chat.completions.create(**args)
    streamed = collect(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert_same_answer(whole, streamed)
    assert streamed["chunks"] > 2 * 24  # one chunk per token, not one per choice

    # A stop string cuts the text (not the ids): the stream holds back what a stop could still cut.
    text = whole.choices[0].message.content
    stop = next(t for t in (tokenizer.decode([i]) for i in whole.choices[0].model_extra["token_ids"][4:])
                if len(t.strip()) > 1 and "\ufffd" not in t and t in text)
    cut_args = {**args, "n": 1, "stop": [stop]}
    whole = client.chat.completions.create(**cut_args)
    assert whole.choices[0].finish_reason == "stop" and stop not in whole.choices[0].message.content
    assert_same_answer(whole, collect(client.chat.completions.create(**cut_args, stream=True,
                                                                     stream_options={"include_usage": True})))


def test_health_reports_time_to_first_token(server, client):
    def ttft() -> tuple[int, float, float]:
        stats = httpx.get(server.base_url + "/health").json()["engines"][MODEL]
        return stats.get("engine/ttft_requests", 0), stats.get("engine/ttft_ms_mean", 0.0), \
            stats.get("engine/ttft_ms_p50", 0.0)

    count, mean, _ = ttft()
    start = time.perf_counter()
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True)
    next(iter(chunks))
    first_chunk_ms = 1000 * (time.perf_counter() - start)
    list(chunks)
    count_after, mean_after, p50 = ttft()
    assert count_after == count + 1 <= TTFT_WINDOW
    assert p50 > 0 and math.isfinite(mean_after)
    # This request's own TTFT, out of the mean: measured in the engine, so within what the client saw.
    own_ms = mean_after * count_after - mean * count
    assert 0 < own_ms <= first_chunk_ms


def test_streams_through_a_replica_set(model, tokenizer, engine):
    """A `ReplicaSet` is an engine too; replica 0 (the backend's own engine) streams token by token."""
    replicas = ReplicaSet(engine, spec=None, count=1)
    with serve(replicas) as thread, openai.OpenAI(base_url=thread.base_url + "/v1", api_key="x",
                                                  max_retries=0) as c:
        args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "seed": 3}
        whole = c.chat.completions.create(**args)
        chunks = list(c.chat.completions.create(**args, stream=True))
    assert whole.model_extra["replica"] == 0 and {ch.model_extra["replica"] for ch in chunks} == {0}
    ids = [i for ch in chunks for x in ch.choices for i in (x.model_extra or {}).get("token_ids") or []]
    assert ids == whole.choices[0].model_extra["token_ids"]


def test_a_stopped_engine_answers_503_with_retry_after(model, tokenizer):
    from art.engine.llm_engine import LLMEngine

    engine = LLMEngine(model, tokenizer)
    with serve(engine) as thread, openai.OpenAI(base_url=thread.base_url + "/v1", api_key="x",
                                                max_retries=0) as c:
        # Stopped mid-stream: the 200 has left, so the stream ends with an error event.
        stopped = False
        with pytest.raises(openai.APIError) as mid:
            for chunk in long_stream(c):
                if not stopped and any((x.model_extra or {}).get("token_ids") for x in chunk.choices):
                    engine.stop()  # returns once the engine thread has answered what it was running
                    stopped = True
        assert mid.value.body["code"] == "unavailable" and "stopped" in mid.value.message
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as stopped:
                c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=stream)
            assert stopped.value.status_code == 503 and stopped.value.code == "unavailable"
            assert stopped.value.response.headers["retry-after"] == "1"
        assert httpx.get(thread.base_url + "/health").status_code == 200
