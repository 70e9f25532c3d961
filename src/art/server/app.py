"""The OpenAI-compatible HTTP face of a backend: /v1/models, /v1/chat/completions, /v1/completions,
/v1/responses and Anthropic's /v1/messages.

The app holds no model state: every request resolves its `model` through the registry it was
given and samples with that engine. It turns chat messages into prompt ids (the engine never
sees messages) and answers in OpenAI's JSON, plus what RL training needs and OpenAI omits:
every choice carries its exact completion `token_ids`, the `prompt_token_ids` (vLLM's
`return_token_ids` names) and per-token logprobs, whether or not the client asked for them.
The prompt is rendered by `art.chat_template` (with `tools`, it shapes the prompt), the answer
by `art.server.openai_format` (which parses `<tool_call>` blocks into `message.tool_calls`; the
ids and logprobs stay exactly as sampled). With `stream=True` each token leaves as a chunk once
the engine samples it (`Engine.stream`, `ChunkWriter`). Errors leave in OpenAI's shape
`{"error": {message, type, param, code}}`, mapped once from `art.errors` (`art.server.errors`);
a failure in one request is answered with a 500 and never takes the server down.

/v1/responses (OpenAI's Responses API, what the OpenAI Agents SDK calls) is no second sampling
path: `art.responses_format` turns the request into the chat request it means, that request is
served as above, and the chat answer (or each chunk of its stream) is written back in the
Responses shape, with the same `token_ids`, `prompt_token_ids`, logprobs and `step` on the
`Response` itself. Anthropic's /v1/messages (what the `anthropic` SDK calls) is served the same
way (`art.messages_format`), written back as a `Message` with `token_ids`,
`prompt_token_ids`, `logprobs` and `step` at its top level, its errors in Anthropic's shape.
/v1/completions (OpenAI's legacy Completions) samples the prompt as sent, text or token ids,
without a chat template (`art.server.completions_format`); its choices carry vLLM's
`token_ids` and `prompt_token_ids` and logprobs in the Completions shape.

A backend whose models may be known only on disk (`art serve` after a restart) passes
`recover`: a model name that does not resolve is offered to it once, and resolved again if it
loaded the model. A `watchdog` (`art.service.watchdog`) turns /health "degraded" while
something is stuck.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from art import messages_format
from art.chat_template import prompt_ids, template_messages, tools_active
from art.engine.base import SamplingParams, ServedModel
from art.errors import ArtError, ArtValueError, ModelNotFoundError
from art.messages_format import MessagesFormatError
from art.observability import tracing
from art.responses_events import ResponseEvents, sse
from art.responses_format import ResponsesFormatError, chat_request, response_object
from art.server import completions_format
from art.server.errors import (
    AsciiJSONResponse,
    as_anthropic,
    error_object,
    error_response,
    install_error_handlers,
    stream_error_event,
)
from art.server.openai_format import (
    ChunkWriter,
    TokenText,
    body_sampling,
    request_attributes,
    response_attributes,
    response_choice,
    response_head,
    token_usage,
)
from art.server.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    MessagesCountRequest,
    MessagesRequest,
    ResponsesRequest,
)
from art.server.registry import ModelRegistry
from art.server.structured_output import grammar_for


def create_app(
    registry: ModelRegistry,
    *,
    default_max_tokens: int = 1024,
    recover: Callable[[str], Awaitable[bool]] | None = None,
    watchdog=None,
) -> FastAPI:
    """Build the app. `default_max_tokens` caps completions whose request sets no limit.
    `recover(model)`: loads a model the registry does not know yet, True if it did.
    `watchdog`: anything with `stuck() -> list[dict]`, shown by /health."""
    app = FastAPI(title="art", docs_url=None, redoc_url=None)
    created = int(time.time())
    install_error_handlers(app)
    serving = _Serving(registry, recover, default_max_tokens)
    # Registered in this order, which is also the order of the OpenAPI document's paths.
    _add_status_routes(app, registry, watchdog, created)
    _add_openai_routes(app, serving)
    _add_anthropic_routes(app, serving)
    return app


def _add_status_routes(app: FastAPI, registry: ModelRegistry, watchdog, created: int) -> None:
    """/health and /v1/models: what the server is up to, without sampling anything."""

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness ("ok", or "degraded" while the watchdog sees something stuck, an engine
        replica is out of rotation or an engine cannot serve, such as a vLLM process that died).
        With the API key (or on a server without one) also each engine's load, what is stuck,
        where, and which replicas are down and why."""
        stuck = watchdog.stuck() if watchdog is not None else []
        engines = registry.stats()
        down = [
            {"model": model, **replica}
            for model, stats in engines.items()
            for replica in stats.get("replicas", [])
            if not replica["serving"]
        ]
        engines_down = [
            {"model": model, "down": stats["engine_down"]}
            for model, stats in engines.items()
            if stats.get("engine_down")
        ]
        body: dict[str, Any] = {"status": "degraded" if stuck or down or engines_down else "ok"}
        if not request.scope.get("state", {}).get("authorized", True):
            return body  # no key: model names and stacks are not for anyone who can reach the port
        body["engines"] = engines
        if watchdog is not None:
            body["stuck"] = stuck
        if down:
            body["replicas_down"] = down
        if engines_down:
            body["engines_down"] = engines_down
        return body

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "art"}
            for name in registry.served_model_names()
        ]
        return {"object": "list", "data": data}


class _Serving:
    """What every sampling route shares: resolving its model (recovering it once if need be) and
    answering inside the request's span."""

    def __init__(
        self,
        registry: ModelRegistry,
        recover: Callable[[str], Awaitable[bool]] | None,
        default_max_tokens: int,
    ) -> None:
        self.registry = registry
        self.recover = recover
        self.default_max_tokens = default_max_tokens

    async def resolve(self, model: str) -> ServedModel:
        """The served model named `model`, offered to `recover` once if the registry lacks it."""
        try:
            return self.registry.resolve(model)
        except ModelNotFoundError:
            if self.recover is None or not await self.recover(model):
                raise
            return self.registry.resolve(model)  # stored on disk, loaded again just now

    async def serve(
        self,
        what: str,
        body: ChatCompletionRequest | CompletionRequest,
        request: Request,
        answer: Callable[[ServedModel, Any], Awaitable[Any]],
        attributes=request_attributes,
    ):
        """Resolve the model and `answer(served, span)` inside the request's span. The caller's
        trace (a rollout's span) continues here: the completion hangs under it. A stream's span
        ends with its last chunk; every other answer ends it here. `attributes(body)`: the span's
        request attributes."""
        response = current = None
        try:
            with tracing.span(
                f"{what.split()[0]} {body.model}",
                kind="SERVER",
                end_on_exit=False,
                context=tracing.extract_context(request.headers),
            ) as current:
                if current is not None:
                    tracing.set_attributes(current, attributes(body))
                try:
                    response = await answer(await self.resolve(body.model), current)
                    return response
                except (ArtError, StarletteHTTPException):
                    raise
                except Exception as exc:  # answered here so it is logged once, without a re-raise
                    tracing.record_failure(current, exc)
                    return error_response(error_object(exc, what))
        finally:
            if current is not None and not isinstance(response, StreamingResponse):
                current.end()

    def answer_as(self, chat: ChatCompletionRequest, fields: dict[str, str], events, sse, written):
        """The `answer` of a request served as the chat request `chat` it means, written back in
        its own API's shape: `fields` renames chat fields in a 400, `events()` and `sse` write a
        stream, `written(result)` a whole answer."""

        async def answer(served: ServedModel, span):
            try:
                result = await _complete(served, chat, self.default_max_tokens, span)
            except ArtValueError as exc:  # named as chat names it: say the request's own field instead
                if exc.field is not None:
                    exc.field = fields.get(exc.field, exc.field)
                raise
            if isinstance(result, StreamingResponse):
                return StreamingResponse(
                    _chat_stream_as(result.body_iterator, events(), sse), media_type="text/event-stream"
                )
            # ASCII JSON: the answer repeats request text (instructions, tools), which may hold a lone surrogate.
            return AsciiJSONResponse(written(result))

        return answer


def _add_openai_routes(app: FastAPI, serving: _Serving) -> None:
    """OpenAI's sampling routes: chat completions, legacy completions and the Responses API."""
    default_max_tokens = serving.default_max_tokens

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.serve(
            "chat completion", body, request, lambda served, span: _complete(served, body, default_max_tokens, span)
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI's legacy Completions: a prompt (text or token ids) without a chat template
        (`art.server.completions_format`)."""
        return await serving.serve(
            "completion",
            body,
            request,
            lambda served, span: completions_format.complete(served, body, default_max_tokens, span),
            completions_format.request_attributes,
        )

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, served as the chat request it means (`art.responses_format`):
        the same prompt, sampling and training fields, written back as a `Response` or its
        stream events."""
        wire = body.model_dump(exclude_none=True)
        chat = _chat_body(wire)
        answer = serving.answer_as(
            chat,
            _RESPONSES_FIELDS,
            lambda: ResponseEvents(wire),
            sse,
            lambda result: response_object(result, wire),
        )
        return await serving.serve("response", chat, request, answer)


def _add_anthropic_routes(app: FastAPI, serving: _Serving) -> None:
    """Anthropic's routes: the Messages API and its token count."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        """Anthropic's Messages API, served as the chat request it means
        (`art.messages_format`), written back as a `Message` or its stream events; errors
        in Anthropic's shape."""
        wire = body.model_dump(exclude_none=True)
        chat = _chat_body(wire, messages_format.chat_request, messages_format.FIELDS)
        answer = serving.answer_as(
            chat,
            messages_format.FIELDS,
            messages_format.MessageEvents,
            sse,
            messages_format.message_object,
        )
        return as_anthropic(await serving.serve("message", chat, request, answer))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesCountRequest) -> dict[str, int]:
        """Anthropic's token count: the length of the prompt the same Messages request renders."""
        chat = _chat_body(body.model_dump(exclude_none=True), messages_format.chat_request, messages_format.FIELDS)
        engine = (await serving.resolve(chat.model)).engine
        prompt, _ = await asyncio.to_thread(_prompt_and_grammar, engine, engine.tokenizer, chat)
        return {"input_tokens": len(prompt)}


async def _complete(served: ServedModel, body: ChatCompletionRequest, default_max_tokens: int, span=None):
    engine = served.engine
    tokenizer = engine.tokenizer
    # Templating and tokenising a long prompt takes seconds: off the event loop, so /health and
    # every other request keep being answered meanwhile.
    prompt, grammar = await asyncio.to_thread(_prompt_and_grammar, engine, tokenizer, body)
    max_tokens = _max_tokens(body, len(prompt), engine.max_model_len, default_max_tokens)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
    params = body_sampling(body, max_tokens=max_tokens, top_logprobs=top_logprobs, grammar=grammar)
    tokens = TokenText(tokenizer)
    parse = tools_active(body.tools, body.tool_choice)
    if body.stream:
        return await _stream(served, body, prompt, params, tokens, parse, span)
    completions = await engine.generate(prompt, params, served.adapter)
    head = response_head(body, served, completions)
    usage = token_usage(prompt, completions)
    if span is not None:
        tracing.set_attributes(span, response_attributes(served, completions, prompt, head))
    choices = [response_choice(i, c, prompt, tokens, parse, params.stop) for i, c in enumerate(completions)]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage, "prompt_token_ids": prompt}


async def _stream(
    served: ServedModel,
    body: ChatCompletionRequest,
    prompt: list[int],
    params: SamplingParams,
    tokens: TokenText,
    parse_tools: bool,
    span,
) -> StreamingResponse:
    """The SSE response, sent as the engine samples. Until the first token nothing is sent, so
    a failure is still an ordinary error response; a later one ends the stream with an error
    event (OpenAI's `{"error": ...}` data line, which the `openai` client raises). The span,
    left open by the route, ends with the stream."""
    events = served.engine.stream(prompt, params, served.adapter)
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    head = response_head(body, served, first if isinstance(first, list) else [first])
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    writer = ChunkWriter(head, prompt, params.n, tokens, params.stop, parse_tools, include_usage)

    async def chunks():
        item = first
        try:
            yield writer.start()
            while not isinstance(item, list):
                for chunk in writer.sampled(item):
                    yield chunk
                item = await anext(events)
            if span is not None:
                tracing.set_attributes(span, response_attributes(served, item, prompt, head))
            for chunk in writer.finish(item, token_usage(prompt, item)):
                yield chunk
        except Exception as exc:  # the 200 has left: the stream ends with the error instead
            tracing.record_failure(span, exc)
            yield stream_error_event(exc, "chat completion stream")
        finally:
            await events.aclose()
            if span is not None:
                span.end()

    return StreamingResponse(chunks(), media_type="text/event-stream")


_RESPONSES_FIELDS = {
    "messages": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}
"""Chat request fields -> the Responses fields they came from (for the 400s that name them)."""


def _chat_body(wire: dict[str, Any], translate=chat_request, fields=_RESPONSES_FIELDS) -> ChatCompletionRequest:
    """The chat request a Responses (or Messages) body means; a 400 naming the field of the
    request as sent when it cannot be one."""
    try:
        return ChatCompletionRequest.model_validate(translate(wire))
    except (ResponsesFormatError, MessagesFormatError) as exc:
        raise ArtValueError(str(exc), exc.param) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        field = fields.get(loc[0], loc[0]) if loc else None
        raise ArtValueError(f"invalid request: {field}: {first.get('msg', 'invalid')}", field) from None


async def _chat_stream_as(chunks, events, sse):
    """A chat stream's SSE lines (`_stream`'s) rewritten as another API's stream events:
    `events` (a `ResponseEvents` or `MessageEvents`) turns each chunk into events, `sse` writes
    them. Closing this closes the chat stream, which ends the request's span."""
    try:
        async for line in chunks:
            for data in (part[len("data: ") :] for part in line.split("\n") if part.startswith("data: ")):
                if data.strip() == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("error"):  # sampling failed after the stream began
                    for event in events.failed(str(chunk["error"].get("message") or "the stream failed")):
                        yield sse(event)
                    return
                for event in events.feed(chunk):
                    yield sse(event)
        for event in events.finish():
            yield sse(event)
    finally:
        await chunks.aclose()


def _prompt_and_grammar(engine, tokenizer, body: ChatCompletionRequest) -> tuple[list[int], str | None]:
    """The prompt's token ids and the completion's grammar (checked), off the event loop."""
    constraint = body.vllm_constraint()
    grammar = grammar_for(
        body.response_format.as_dict() if body.response_format else None,
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        constraint[:2] if constraint else None,
    )
    if grammar is not None:
        forced_field = "response_format" if body.response_format and body.response_format.type != "text" else "tools"
        engine.grammars.check(grammar, constraint[2] if constraint else forced_field)
    return _prompt_ids(tokenizer, body), grammar


def _prompt_ids(tokenizer, body: ChatCompletionRequest) -> list[int]:
    messages, tools = template_messages(
        tokenizer, [m.for_template() for m in body.messages], body.tools, body.tool_choice
    )
    return prompt_ids(
        tokenizer,
        messages,
        tools,
        add_generation_prompt=True,
        where="messages",
        template_kwargs=body.chat_template_kwargs,
    )


def _max_tokens(body: ChatCompletionRequest, prompt_len: int, max_model_len: int, default: int) -> int:
    return completions_format.completion_tokens(
        body.requested_max_tokens, prompt_len, max_model_len, default, where="messages", prompt_name="messages"
    )
