"""ART's 2026 capture: `with art.Trajectory()` scopes, four APIs recorded as exchanges through three
HTTP libraries, and the Trajectory model's ART details.

The endpoint is a scripted OpenAI- and Anthropic-compatible server on loopback (aiohttp), which
answers each API with a fixed body carrying the token-id extras vLLM-style servers add; the
clients are the real ones (httpx, requests, aiohttp, the openai and anthropic SDKs).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import aiohttp
import httpx
import pytest
import pytest_asyncio
import requests
from aiohttp import web
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI
from openai.types.chat.chat_completion import Choice

import art
from art.exchanges import IncompleteExchange, build_exchange
from art.training.sequences import sequences_of_trajectory

LOGPROB = {"token": "token_id:7", "logprob": -0.25, "bytes": [104], "top_logprobs": []}
CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "served/model",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hello"},
                     "logprobs": {"content": [LOGPROB]}, "token_ids": [7], "prompt_token_ids": [1, 2], "step": 3}]}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "served/model",
              "choices": [{"index": 0, "finish_reason": "stop", "text": " world", "token_ids": [8, 9],
                           "prompt_token_ids": [4, 5],
                           "logprobs": {"tokens": ["token_id:8", "token_id:9"], "token_logprobs": [-0.5, -0.75],
                                        "top_logprobs": [{}, {}], "text_offset": [0, 3]}}]}
RESPONSE = {"id": "resp_1", "created_at": 1.0, "model": "served/model", "object": "response", "status": "completed",
            "output": [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "hello", "annotations": []}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "token_ids": [7], "prompt_token_ids": [1, 2], "logprobs": {"content": [LOGPROB]}}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "served/model",
           "content": [{"type": "text", "text": "hello"},
                       {"type": "tool_use", "id": "toolu_1", "name": "pick", "input": {"x": "a"}}],
           "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 2, "output_tokens": 3},
           "token_ids": [7, 10, 11], "logprobs": [-0.25, -0.5, -0.125], "prompt_token_ids": [1, 2], "step": 5}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/responses": RESPONSE,
          "/v1/messages": MESSAGE}


def sse(events: list[tuple[str | None, Any]]) -> bytes:
    out = ""
    for name, value in events:
        out += (f"event: {name}\n" if name else "") + f"data: {value if isinstance(value, str) else json.dumps(value)}\n\n"
    return out.encode()


@pytest_asyncio.fixture
async def endpoint():
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("fail"):
            return web.json_response({"error": {"message": "refused"}}, status=400)
        if body.get("cut"):  # a stream that stops before its end
            return web.Response(body=sse([(None, {"type": "nothing"})]), content_type="text/event-stream")
        return web.json_response(BODIES[request.path])

    app = web.Application()
    app.router.add_post("/v1/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


async def test_scopes_nest_follow_tasks_and_fill_groups():
    assert art.current_trajectory() is None
    with art.TrajectoryGroup() as group:
        assert art.current_trajectory_group() is group
        with art.Trajectory() as outer:
            assert art.current_trajectory(required=True) is outer
            with art.Trajectory() as inner:
                assert art.current_trajectory() is inner
            assert art.current_trajectory() is outer

            async def child() -> art.Trajectory:
                with art.Trajectory() as mine:
                    await asyncio.sleep(0)
                    assert art.current_trajectory() is mine
                return mine

            first, second = await asyncio.gather(child(), child())
            assert first is not second and art.current_trajectory() is outer
    # Every trajectory whose block closed inside the group's joined it, in the order they closed.
    assert group.trajectories[0] is inner and group.trajectories[-1] is outer and len(group) == 4
    assert outer.end_time is not None
    assert art.current_trajectory() is None and art.current_trajectory_group() is None
    with pytest.raises(RuntimeError, match="No trajectory"):
        art.current_trajectory(required=True)

    task = asyncio.ensure_future(asyncio.sleep(0))
    with pytest.raises(TypeError, match="raw coroutine"):
        await art.trajectory(task)  # type: ignore[arg-type]
    await task


async def test_httpx_requests_and_aiohttp_each_record_once(endpoint):
    body = {"model": "served/model", "messages": [{"role": "user", "content": "hi"}]}

    def with_requests() -> None:
        requests.post(f"{endpoint}/chat/completions", json=body, timeout=5).raise_for_status()
        with requests.post(f"{endpoint}/chat/completions", json=body, stream=True, timeout=5) as response:
            list(response.iter_content(chunk_size=5))  # read in small pieces

    with art.Trajectory() as trajectory:
        async with httpx.AsyncClient() as client:
            (await client.post(f"{endpoint}/chat/completions", json=body)).raise_for_status()
        await asyncio.to_thread(with_requests)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{endpoint}/chat/completions", json=body) as response:
                await response.json()
            async with session.post(f"{endpoint}/chat/completions", json=body) as response:
                async for _ in response.content.iter_chunked(7):
                    pass
    calls = trajectory.exchanges.chat_completions
    assert len(calls) == 5, trajectory.logs
    assert {c.response.choices[0].message.content for c in calls} == {"hello"}
    # The five identical calls extend nothing of each other: one turn each, all trainable.
    assert len(trajectory.additional_histories) == 4
    assert len(sequences_of_trajectory(trajectory, Counter())) == 5


async def test_openai_and_anthropic_sdks_record_four_apis_that_train(endpoint):
    openai = AsyncOpenAI(base_url=endpoint, api_key="test")
    anthropic = AsyncAnthropic(base_url=endpoint.removesuffix("/v1"), api_key="test")
    tools = [{"name": "pick", "description": "Pick one.", "input_schema": {"type": "object"}}]
    with art.Trajectory() as trajectory:
        chat = await openai.chat.completions.create(model="served/model", messages=[{"role": "user", "content": "hi"}])
        completion = await openai.completions.create(model="served/model", prompt="hello")
        response = await openai.responses.create(model="served/model", input="hi")
        message = await anthropic.messages.create(model="served/model", max_tokens=16, system="Be brief.",
                                                  messages=[{"role": "user", "content": "pick"}], tools=tools)
    await openai.close()
    await anthropic.close()
    assert (chat.choices[0].message.content, completion.choices[0].text) == ("hello", " world")
    assert response.output_text == "hello" and message.content[0].text == "hello"
    exchanges = trajectory.exchanges
    assert [len(exchanges.chat_completions), len(exchanges.completions), len(exchanges.responses),
            len(exchanges.messages)] == [1, 1, 1, 1]
    assert exchanges.messages[0].response.content[1].input == {"x": "a"}
    assert [type(e).__name__ for e in exchanges.in_order()] == [
        "ChatCompletionsExchange", "CompletionsExchange", "ResponsesExchange", "MessagesExchange"]

    # The turns that train carry each API's exact ids: the Anthropic one as a chat tool call.
    histories = [trajectory.messages_and_choices, *(h.messages_and_choices for h in trajectory.additional_histories)]
    choices = [item for history in histories for item in history if isinstance(item, Choice)]
    assert [c.token_ids for c in choices] == [[7], [8, 9], [7], [7, 10, 11]]
    anthropic_turn = choices[-1]
    assert anthropic_turn.finish_reason == "tool_calls"
    assert json.loads(anthropic_turn.message.tool_calls[0].function.arguments) == {"x": "a"}
    assert [e.logprob for e in anthropic_turn.logprobs.content] == [-0.25, -0.5, -0.125]
    last = trajectory.additional_histories[-1]
    assert last.messages()[0] == {"role": "system", "content": "Be brief."}
    assert last.tools[0]["function"]["name"] == "pick"
    sequences = sequences_of_trajectory(trajectory, Counter())
    assert [s.token_ids for s in sequences] == [[1, 2, 7], [4, 5, 8, 9], [1, 2, 7], [1, 2, 7, 10, 11]]
    # Dated by the steps the server said sampled them (the chat turn's 3, the message's 5).
    assert (trajectory.initial_policy_version, trajectory.final_policy_version) == (3, 5)


async def test_failed_and_unfinished_calls_are_left_out_and_said(endpoint):
    async with httpx.AsyncClient() as client:
        with art.Trajectory() as trajectory:
            await client.post(f"{endpoint}/chat/completions", json={"model": "m", "messages": [], "fail": True})
            await client.post(f"{endpoint}/messages", json={"model": "m", "messages": [], "stream": True, "cut": True})
    assert not trajectory.exchanges and trajectory.messages_and_choices == []
    assert trajectory.logs == ["a chat completion failed with HTTP 400; not recorded",
                               "a streamed message ended before message_stop; not recorded"]


def test_every_api_rebuilds_its_answer_whole_or_streamed():
    now = datetime.now()
    times = {"start_time": now, "end_time": now + timedelta(seconds=1)}
    for endpoint, request, body in [("chat_completions", {"model": "asked", "messages": []}, CHAT),
                                    ("completions", {"model": "asked", "prompt": "hi"}, COMPLETION),
                                    ("responses", {"input": "hi"}, RESPONSE),
                                    ("messages", {"model": "asked", "messages": []}, MESSAGE)]:
        name, exchange = build_exchange(endpoint, request, json.dumps(body).encode(), **times)
        assert name == endpoint and exchange.model == request.get("model", "served/model")
        assert exchange.model_dump(mode="json")["request"] == request

    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "served/model",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hel"}, "finish_reason": None,
                          "token_ids": [7]}]}
    tail = {**chunk, "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None, "token_ids": [8]}]}
    _, chat = build_exchange("chat_completions", {"stream": True}, sse([(None, chunk), (None, tail), (None, "[DONE]")]),
                             **times)
    assert chat.response.choices[0].message.content == "hello" and chat.response.choices[0].finish_reason == "stop"
    assert chat.response.choices[0].token_ids == [7, 8]

    pieces = [{**COMPLETION, "choices": [{**COMPLETION["choices"][0], "text": text, "token_ids": [i],
                                          "logprobs": {"tokens": [f"token_id:{i}"], "token_logprobs": [lp]},
                                          "finish_reason": reason}]}
              for text, i, lp, reason in ((" wor", 8, -0.5, None), ("ld", 9, -0.75, "length"))]
    _, completion = build_exchange("completions", {"stream": True}, sse([(None, p) for p in pieces] + [(None, "[DONE]")]),
                                   **times)
    choice = completion.response.choices[0]
    assert (choice.text, choice.finish_reason, choice.token_ids) == (" world", "length", [8, 9])
    assert choice.logprobs.token_logprobs == [-0.5, -0.75]

    events = [("message_start", {"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None,
                                                                      "usage": {"input_tokens": 2, "output_tokens": 0}}}),
              ("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "tool_use", "id": "t", "name": "pick", "input": {}}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "input_json_delta", "partial_json": '{"x": '}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "input_json_delta", "partial_json": '"b"}'}}),
              ("content_block_stop", {"type": "content_block_stop", "index": 0}),
              ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                 "usage": {"output_tokens": 2}, "token_ids": [10, 11], "logprobs": [-0.5, -0.125]}),
              ("message_stop", {"type": "message_stop"})]
    _, message = build_exchange("messages", {"stream": True}, sse(events), **times)
    assert message.response.content[0].input == {"x": "b"} and message.response.stop_reason == "tool_use"
    assert message.response.usage.output_tokens == 2 and message.response.usage.input_tokens == 2
    assert message.response.model_extra["token_ids"] == [10, 11]
    with pytest.raises(IncompleteExchange, match="before message_stop"):
        build_exchange("messages", {"stream": True}, sse(events[:-1]), **times)
    with pytest.raises(IncompleteExchange, match="before it completed"):
        build_exchange("responses", {"stream": True}, sse([(None, {"type": "response.created"})]), **times)


def test_trajectory_model_details_follow_art():
    assert art.Trajectory().model_dump() == {} and art.TrajectoryGroup().model_dump() == {}
    assert set(art.Trajectory().model_dump(exclude_defaults=False)) >= {"reward", "messages_and_choices", "start_time"}
    nested = art.Trajectory(reward=1.0, metadata={"nested": {"items": [1, "two"]}, "tags": ["a"]})
    assert nested.model_dump(mode="json") == {"reward": 1.0, "metadata": {"nested": {"items": [1, "two"]},
                                                                         "tags": ["a"]}}
    assert nested.for_logging()["metadata"] == {"nested": {"items": [1, "two"]}, "tags": ["a"]}
    dumped_choice = Choice.model_validate(CHAT["choices"][0]).model_dump(mode="json")
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, dumped_choice])
    assert isinstance(trajectory.messages_and_choices[1], Choice)
    assert trajectory.messages_and_choices[1].token_ids == [7]
    odd = {"index": 0, "finish_reason": "eos", "message": {"role": "assistant", "content": "x"}}  # not OpenAI's
    kept = art.Trajectory(messages_and_choices=[odd]).messages_and_choices
    assert kept == [odd] and not isinstance(kept[0], Choice)  # kept as given, as ART keeps it
