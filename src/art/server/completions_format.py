"""POST /v1/completions (OpenAI's legacy Completions) served from an engine: a prompt in, as text
or token ids, and the choices out with what RL training needs, as vLLM returns them with
`return_token_ids`: each choice's exact completion `token_ids` and its `prompt_token_ids`
(vLLM's names), `step` (the weights that sampled it), vLLM's `stop_reason` (the stop string
that ended it), and always `logprobs` in the Completions shape: `tokens`, `token_logprobs` (the
sampled ids' logprobs), `text_offset`, and `top_logprobs` (null unless `logprobs=k` asked for
k alternatives; the sampled token is among them, as vLLM does). With vLLM's
`return_tokens_as_token_ids` the `tokens` read "token_id:<id>".

No chat template is applied: a string prompt is tokenized as it is (with the tokenizer's special
tokens unless `add_special_tokens` is false, as vLLM does), ids are checked against the
vocabulary and sampled from as sent. A batch (a list of prompts) is sampled concurrently; choice
`index` is prompt index * n + sample index, as OpenAI numbers them, and each choice carries its
own prompt's ids. `echo` puts the prompt's text before each completion's text (its ids stay in
`prompt_token_ids`; `logprobs` is then null, since prompt logprobs are not computed).

A stream sends a first chunk with every choice's `prompt_token_ids` (and the echoed prompt),
then one chunk per sampled token with its text delta, `token_ids` and logprobs entry, a finish
chunk per choice, the usage chunk when `stream_options.include_usage`, and `data: [DONE]`. A
batch streams its prompts one after another. Nothing here knows routes or registries.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from art.engine.base import Completion, SampledTokens, ServedModel
from art.errors import ArtValueError, ContextLengthError
from art.observability import tracing
from art.server.errors import stream_error_event
from art.server.openai_format import (
    IncrementalText,
    TokenText,
    body_sampling,
    matched_stop,
    response_attributes,
    response_head,
)
from art.server.openai_schemas import CompletionRequest


def request_attributes(body: CompletionRequest) -> dict[str, Any]:
    """GenAI semantic-convention attributes of a completions request."""
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "art",
        "gen_ai.request.model": body.model,
        "gen_ai.request.temperature": body.temperature,
        "gen_ai.request.top_p": body.top_p,
        "gen_ai.request.max_tokens": body.max_tokens,
        "gen_ai.request.choice.count": body.n,
        "gen_ai.request.seed": body.seed,
        "openinference.span.kind": "LLM",
        "llm.model_name": body.model,
        "langfuse.observation.type": "generation",
        "input.value": json.dumps(body.prompt, ensure_ascii=False),
        "input.mime_type": "application/json",
    }


def prompt_token_ids(tokenizer, prompt: str | list[int], add_special_tokens: bool, where: str) -> list[int]:
    """The ids a prompt stands for: a string tokenized, ids checked against the vocabulary."""
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    else:
        ids = list(prompt)
        vocab = len(tokenizer)
        outside = next((t for t in ids if t >= vocab), None)
        if outside is not None:
            raise ArtValueError(
                f"{where} holds the token id {outside}, outside the vocabulary (ids 0 to {vocab - 1})", where
            )
    if not ids:
        raise ArtValueError(f"{where} is empty: give at least one token of text", where)
    return ids


def completion_tokens(
    asked: int | None, prompt_len: int, max_model_len: int, default: int, where: str, prompt_name: str = "prompt"
) -> int:
    """`max_tokens` for one prompt: what was asked if it fits the context (None: as much as the
    context and the server's default allow). The error is OpenAI's, the prompt called `prompt_name`
    (chat says "messages")."""
    room = max_model_len - prompt_len
    if asked is None and room >= 1:
        return min(default, room)
    if asked is None or asked > room:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + (asked or 1)} tokens ({prompt_len} in the {prompt_name}, {asked or 1} in the completion). "
            f"Please reduce the length of the {prompt_name} or completion.",
            where,
        )
    return asked


class Logprobs:
    """The Completions `logprobs` object of a choice, token by token (`text_offset` runs on)."""

    def __init__(self, tokens: TokenText, top: int | None, as_ids: bool, offset: int = 0) -> None:
        self.tokens, self.top, self.as_ids, self.offset = tokens, top, as_ids, offset

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokens.text(token_id)

    def block(self, sampled: Completion | SampledTokens, start: int = 0, end: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": None if self.top is None else [],
            "text_offset": [],
        }
        for k in range(start, len(sampled.token_ids) if end is None else end):
            token_id, logprob = sampled.token_ids[k], sampled.logprobs[k]
            name = self.name(token_id)
            out["tokens"].append(name)
            out["token_logprobs"].append(logprob)
            out["text_offset"].append(self.offset)
            self.offset += len(self.tokens.text(token_id))
            if self.top is not None:
                alternatives = sampled.top_logprobs[k][: self.top] if k < len(sampled.top_logprobs) else []
                out["top_logprobs"].append({**{self.name(t): lp for t, lp in alternatives}, name: logprob})
        return out


class Batch:
    """One request's prompts and what its choices share: the ids, echoed texts, sampling params."""

    def __init__(self, served: ServedModel, body: CompletionRequest, default_max_tokens: int) -> None:
        engine = served.engine
        self.body, self.tokens = body, TokenText(engine.tokenizer)
        prompts = body.prompts
        where = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        self.ids = [prompt_token_ids(engine.tokenizer, p, body.add_special_tokens, at) for p, at in zip(prompts, where)]
        self.echoes = [
            (p if isinstance(p, str) else engine.tokenizer.decode(ids)) if body.echo else ""
            for p, ids in zip(prompts, self.ids)
        ]
        base = body_sampling(body, top_logprobs=body.logprobs or 0)
        self.params = [
            dataclasses.replace(
                base,
                max_tokens=completion_tokens(body.max_tokens, len(ids), engine.max_model_len, default_max_tokens, at),
            )
            for ids, at in zip(self.ids, where)
        ]

    def logprobs(self, p: int) -> Logprobs | None:
        if self.body.echo:
            return None
        return Logprobs(self.tokens, self.body.logprobs, self.body.return_tokens_as_token_ids, len(self.echoes[p]))

    def usage(self, completions: list[list[Completion]]) -> dict[str, int]:
        prompt = sum(len(ids) for ids in self.ids)
        generated = sum(len(c.token_ids) for cs in completions for c in cs)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def head(self, served: ServedModel, sampled: list) -> dict[str, Any]:
        return {**response_head(self.body, served, sampled), "id": f"cmpl-{uuid.uuid4().hex}"}

    def prompt(self) -> dict[str, Any]:
        """The response's own `prompt_token_ids` (as chat's): only a single prompt has one."""
        return {"prompt_token_ids": self.ids[0]} if len(self.ids) == 1 else {}

    def choice(self, p: int, i: int, c: Completion) -> dict[str, Any]:
        logprobs = self.logprobs(p)
        choice = {
            "index": p * self.body.n + i,
            "text": self.echoes[p] + c.text,
            "logprobs": logprobs.block(c) if logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": matched_stop(self.tokens.tokenizer, c, self.params[p].stop),
            "token_ids": c.token_ids,
            "prompt_token_ids": self.ids[p],
        }
        if c.step is not None:
            choice["step"] = c.step
        return choice


async def complete(served: ServedModel, body: CompletionRequest, default_max_tokens: int, span=None):
    """The answer to a completions request: the response dict, or the StreamingResponse."""
    engine = served.engine
    # Tokenizing long prompts takes a while: off the event loop, as chat's templating is.
    batch = await asyncio.to_thread(Batch, served, body, default_max_tokens)
    if body.stream:
        return await _stream(served, batch, span)
    results = await asyncio.gather(
        *(engine.generate(ids, params, served.adapter) for ids, params in zip(batch.ids, batch.params))
    )
    head = batch.head(served, [c for cs in results for c in cs])
    if span is not None:
        tracing.set_attributes(
            span,
            response_attributes(served, [c for cs in results for c in cs], [t for ids in batch.ids for t in ids], head),
        )
    choices = [batch.choice(p, i, c) for p, cs in enumerate(results) for i, c in enumerate(cs)]
    return {**head, "object": "text_completion", "choices": choices, "usage": batch.usage(results), **batch.prompt()}


class Chunks:
    """The SSE chunks of a streamed completions request, built as tokens arrive."""

    def __init__(self, batch: Batch, head: dict[str, Any]) -> None:
        self.batch, self.head = batch, head
        self.include_usage = bool(batch.body.stream_options and batch.body.stream_options.include_usage)
        self.texts: dict[int, IncrementalText] = {}
        self.logprobs: dict[int, Logprobs | None] = {}

    def sse(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {**self.head, "object": "text_completion", "choices": choices, **extra}
        if self.include_usage:
            chunk.setdefault("usage", None)
        return f"data: {json.dumps(chunk)}\n\n"

    def start(self) -> str:
        n = self.batch.body.n
        return self.sse(
            [
                {"index": p * n + i, "text": echo, "logprobs": None, "finish_reason": None, "prompt_token_ids": ids}
                for p, (ids, echo) in enumerate(zip(self.batch.ids, self.batch.echoes))
                for i in range(n)
            ],
            **self.batch.prompt(),
        )

    def sampled(self, p: int, sampled: SampledTokens) -> Iterator[str]:
        index = p * self.batch.body.n + sampled.index
        if index not in self.texts:
            self.texts[index] = IncrementalText(self.batch.tokens.tokenizer, self.batch.params[p].stop)
            self.logprobs[index] = self.batch.logprobs(p)
        text, logprobs = self.texts[index], self.logprobs[index]
        for k, token_id in enumerate(sampled.token_ids):
            yield self.sse(
                [
                    {
                        "index": index,
                        "text": text.add(token_id),
                        "logprobs": logprobs.block(sampled, k, k + 1) if logprobs else None,
                        "finish_reason": None,
                        "token_ids": [token_id],
                    }
                ]
            )

    def finish(self, p: int, completions: list[Completion]) -> Iterator[str]:
        for i, c in enumerate(completions):
            index = p * self.batch.body.n + i
            text = self.texts.get(index)
            rest = text.rest(c.text) if text is not None else c.text
            yield self.sse(
                [
                    {
                        "index": index,
                        "text": rest,
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": matched_stop(self.batch.tokens.tokenizer, c, self.batch.params[p].stop),
                    }
                ]
            )

    def end(self, usage: dict[str, int]) -> Iterator[str]:
        if self.include_usage:
            yield self.sse([], usage=usage)
        yield "data: [DONE]\n\n"


async def _stream(served: ServedModel, batch: Batch, span) -> StreamingResponse:
    """The SSE response. Until the first token nothing is sent, so a failure is still an ordinary
    error response; a later one ends the stream with OpenAI's `{"error": ...}` data line."""
    engine = served.engine
    streams: list[AsyncGenerator[SampledTokens | list[Completion], None]] = []

    def open_stream(p: int) -> AsyncGenerator[SampledTokens | list[Completion], None]:
        streams.append(engine.stream(batch.ids[p], batch.params[p], served.adapter))
        return streams[-1]

    events = open_stream(0)
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    chunks = Chunks(batch, batch.head(served, first if isinstance(first, list) else [first]))

    async def lines() -> AsyncGenerator[str, None]:
        results: list[list[Completion]] = []
        try:
            yield chunks.start()
            for p in range(len(batch.ids)):
                source = events if p == 0 else open_stream(p)
                item = first if p == 0 else await anext(source)
                while not isinstance(item, list):
                    for line in chunks.sampled(p, item):
                        yield line
                    item = await anext(source)
                results.append(item)
                for line in chunks.finish(p, item):
                    yield line
            if span is not None:
                tracing.set_attributes(
                    span,
                    response_attributes(
                        served, [c for cs in results for c in cs], [t for ids in batch.ids for t in ids], chunks.head
                    ),
                )
            for line in chunks.end(batch.usage(results)):
                yield line
        except Exception as exc:  # the 200 has left: the stream ends with the error instead
            tracing.record_failure(span, exc)
            yield stream_error_event(exc, "completion stream")
        finally:
            for source in streams:
                await source.aclose()
            if span is not None:
                span.end()

    return StreamingResponse(lines(), media_type="text/event-stream")
