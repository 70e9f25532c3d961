"""The OpenAI-compatible HTTP face of a backend: /v1/models and /v1/chat/completions.

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
from starlette.exceptions import HTTPException as StarletteHTTPException

from art.chat_template import prompt_ids, template_messages, tools_active
from art.engine.base import SamplingParams, ServedModel, stream_completions
from art.errors import ArtError, ContextLengthError, ModelNotFoundError
from art.observability import tracing
from art.server.errors import error_object, error_response, install_error_handlers
from art.server.openai_format import (ChunkWriter, TokenText, request_attributes, response_attributes,
                                      response_choice, response_head, token_usage)
from art.server.registry import ModelRegistry
from art.server.schemas import ChatCompletionRequest
from art.server.structured_output import grammar_for

def create_app(registry: ModelRegistry, *, default_max_tokens: int = 1024,
               recover: Callable[[str], Awaitable[bool]] | None = None, watchdog=None) -> FastAPI:
    """Build the app. `default_max_tokens` caps completions whose request sets no limit.
    `recover(model)`: loads a model the registry does not know yet, True if it did.
    `watchdog`: anything with `stuck() -> list[dict]`, shown by /health."""
    app = FastAPI(title="art", docs_url=None, redoc_url=None)
    created = int(time.time())
    install_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness ("ok", or "degraded" while the watchdog sees something stuck or an engine
        replica is out of rotation). With the API key (or on a server without one) also each
        engine's load, what is stuck, where, and which replicas are down and why."""
        stuck = watchdog.stuck() if watchdog is not None else []
        engines = registry.stats() if hasattr(registry, "stats") else {}
        down = [{"model": model, **replica} for model, stats in engines.items()
                for replica in stats.get("replicas", []) if not replica["serving"]]
        body: dict[str, Any] = {"status": "degraded" if stuck or down else "ok"}
        if not request.scope.get("state", {}).get("authorized", True):
            return body  # no key: model names and stacks are not for anyone who can reach the port
        body["engines"] = engines
        if watchdog is not None:
            body["stuck"] = stuck
        if down:
            body["replicas_down"] = down
        return body

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "art"}
            for name in registry.served_model_names()
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        # The caller's trace (a rollout's span) continues here: the completion hangs under it.
        # A stream's span ends with its last chunk; every other answer ends it here.
        response = current = None
        try:
            with tracing.span(f"chat {body.model}", kind="SERVER", end_on_exit=False,
                              context=tracing.extract_context(request.headers)) as current:
                if current is not None:
                    tracing.set_attributes(current, request_attributes(body))
                try:
                    try:
                        served = registry.resolve(body.model)
                    except ModelNotFoundError:
                        if recover is None or not await recover(body.model):
                            raise
                        served = registry.resolve(body.model)  # stored on disk, loaded again just now
                    response = await _complete(served, body, default_max_tokens, current)
                    return response
                except (ArtError, StarletteHTTPException):
                    raise
                except Exception as exc:  # answered here so it is logged once, without a re-raise
                    tracing.record_failure(current, exc)
                    return error_response(error_object(exc, "chat completion"))
        finally:
            if current is not None and not isinstance(response, StreamingResponse):
                current.end()

    return app


async def _complete(served: ServedModel, body: ChatCompletionRequest, default_max_tokens: int, span=None):
    engine = served.engine
    tokenizer = engine.tokenizer
    # Templating and tokenising a long prompt takes seconds: off the event loop, so /health and
    # every other request keep being answered meanwhile.
    prompt, grammar = await asyncio.to_thread(_prompt_and_grammar, engine, tokenizer, body)
    max_tokens = _max_tokens(body, len(prompt), engine.max_model_len, default_max_tokens)
    params = SamplingParams(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        max_tokens=max_tokens,
        stop=body.stop_strings,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        grammar=grammar,
    )
    tokens = TokenText(tokenizer)
    parse = tools_active(body.tools, body.tool_choice)
    if body.stream:
        return await _stream(served, body, prompt, params, tokens, parse, span)
    completions = await engine.generate(prompt, params, served.adapter)
    head = response_head(body, served, completions)
    usage = token_usage(prompt, completions)
    if span is not None:
        tracing.set_attributes(span, response_attributes(served, completions, prompt, head))
    choices = [response_choice(i, c, prompt, tokens, parse) for i, c in enumerate(completions)]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage, "prompt_token_ids": prompt}


async def _stream(served: ServedModel, body: ChatCompletionRequest, prompt: list[int], params: SamplingParams,
                  tokens: TokenText, parse_tools: bool, span) -> StreamingResponse:
    """The SSE response, sent as the engine samples. Until the first token nothing is sent, so
    a failure is still an ordinary error response; a later one ends the stream with an error
    event (OpenAI's `{"error": ...}` data line, which the `openai` client raises). The span,
    left open by the route, ends with the stream."""
    events = stream_completions(served.engine, prompt, params, served.adapter)
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
            error = error_object(exc, "chat completion stream")
            error.pop("status")
            yield f"data: {json.dumps({'error': error})}\n\n"
        finally:
            await events.aclose()
            if span is not None:
                span.end()

    return StreamingResponse(chunks(), media_type="text/event-stream")


def _prompt_and_grammar(engine, tokenizer, body: ChatCompletionRequest) -> tuple[list[int], str | None]:
    """The prompt's token ids and the completion's grammar (checked), off the event loop."""
    grammar = grammar_for(body.response_format.as_dict() if body.response_format else None,
                          body.tools, body.tool_choice, body.parallel_tool_calls)
    if grammar is not None:
        field = "response_format" if body.response_format and body.response_format.type != "text" else "tools"
        engine.grammars.check(grammar, field)
    return _prompt_ids(tokenizer, body), grammar


def _prompt_ids(tokenizer, body: ChatCompletionRequest) -> list[int]:
    messages, tools = template_messages(
        tokenizer, [m.for_template() for m in body.messages], body.tools, body.tool_choice
    )
    return prompt_ids(tokenizer, messages, tools, add_generation_prompt=True, where="messages",
                      template_kwargs=body.chat_template_kwargs)


def _max_tokens(body: ChatCompletionRequest, prompt_len: int, max_model_len: int, default: int) -> int:
    asked = body.requested_max_tokens
    room = max_model_len - prompt_len
    if asked is None and room >= 1:
        return min(default, room)
    if asked is None or asked > room:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + (asked or 1)} tokens ({prompt_len} in the messages, "
            f"{asked or 1} in the completion). Please reduce the length of the messages or "
            "completion.",
            "messages",
        )
    return asked

