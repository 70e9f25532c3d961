"""The OpenAI-compatible HTTP face of a backend: /v1/models and /v1/chat/completions.

The app holds no model state: every request resolves its `model` through the registry it was
given and samples with that engine. It turns chat messages into prompt ids (the engine never
sees messages) and answers in OpenAI's JSON, plus what RL training needs and OpenAI omits:
every choice carries its exact completion `token_ids`, the `prompt_token_ids` (vLLM's
`return_token_ids` names) and per-token logprobs, whether or not the client asked for them.
With `tools`, `art.server.tools` shapes the prompt and parses `<tool_call>` blocks into
`message.tool_calls`; the ids and logprobs stay exactly as sampled. With `stream=True` each
token leaves as a chunk once the engine samples it (`Engine.stream`, `_ChunkWriter`).
Errors leave in OpenAI's shape `{"error": {message, type, param, code}}`, mapped once from
`art.errors` (`error_object`); a failure in one request is answered with a 500 and never
takes the server down.

A backend whose models may be known only on disk (`art serve` after a restart) passes
`recover`: a model name that does not resolve is offered to it once, and resolved again if it
loaded the model. A `watchdog` (`art.service.watchdog`) turns /health "degraded" while
something is stuck.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from art.engine.base import Completion, SampledTokens, SamplingParams, ServedModel, stream_completions
from art.errors import (ArtError, ArtValueError, BackendUnavailableError, ContextLengthError, ModelNotFoundError,
                        StepCancelledError, StepConflictError)
from art.naming import echo
from art.observability import tracing
from art.server.registry import ModelRegistry
from art.server.schemas import ChatCompletionRequest
from art.server.structured_output import grammar_for
from art.server.tools import split_completion, stream_deltas, template_messages, tools_active

log = logging.getLogger(__name__)


def create_app(registry: ModelRegistry, *, default_max_tokens: int = 1024,
               recover: Callable[[str], Awaitable[bool]] | None = None, watchdog=None) -> FastAPI:
    """Build the app. `default_max_tokens` caps completions whose request sets no limit.
    `recover(model)`: loads a model the registry does not know yet, True if it did.
    `watchdog`: anything with `stuck() -> list[dict]`, shown by /health."""
    app = FastAPI(title="art", docs_url=None, redoc_url=None)
    created = int(time.time())
    _install_error_handlers(app)

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
                    tracing.set_attributes(current, _request_attributes(body))
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


def _request_attributes(body: ChatCompletionRequest) -> dict[str, Any]:
    """GenAI semantic-convention attributes of a chat request (and what Phoenix reads)."""
    return {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "art", "gen_ai.request.model": body.model,
            "gen_ai.request.temperature": body.temperature, "gen_ai.request.top_p": body.top_p,
            "gen_ai.request.max_tokens": body.requested_max_tokens, "gen_ai.request.choice.count": body.n,
            "gen_ai.request.seed": body.seed, "openinference.span.kind": "LLM", "llm.model_name": body.model,
            "langfuse.observation.type": "generation",
            "input.value": json.dumps([m.for_template() for m in body.messages], default=str, ensure_ascii=False),
            "input.mime_type": "application/json"}


def _response_attributes(served: ServedModel, completions: list[Completion], prompt: list[int],
                         head: dict) -> dict[str, Any]:
    first = completions[0] if completions else None
    prompt_tokens, generated = len(prompt), sum(len(c.token_ids) for c in completions)
    return {
        "gen_ai.response.id": head["id"], "gen_ai.response.model": served.name,
        "gen_ai.response.finish_reasons": [c.finish_reason for c in completions],
        "gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": generated,
        "llm.token_count.prompt": prompt_tokens, "llm.token_count.completion": generated,
        "art.step": head["step"], "art.adapter": served.adapter.key if served.adapter else None,
        "art.queue_time_s": first.queue_s if first else None,
        "art.time_to_first_token_s": first.time_to_first_token_s if first else None,
        "output.value": json.dumps([c.text for c in completions], ensure_ascii=False),
        "gen_ai.completion": json.dumps([c.text for c in completions], ensure_ascii=False),
    }


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
    tokens = _TokenText(tokenizer)
    parse = tools_active(body.tools, body.tool_choice)
    if body.stream:
        return await _stream(served, body, prompt, params, tokens, parse, span)
    completions = await engine.generate(prompt, params, served.adapter)
    head = _head(body, served, completions)
    usage = _usage(prompt, completions)
    if span is not None:
        tracing.set_attributes(span, _response_attributes(served, completions, prompt, head))
    choices = [_choice(i, c, prompt, tokens, parse) for i, c in enumerate(completions)]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage, "prompt_token_ids": prompt}


async def _stream(served: ServedModel, body: ChatCompletionRequest, prompt: list[int], params: SamplingParams,
                  tokens: _TokenText, parse_tools: bool, span) -> StreamingResponse:
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
    head = _head(body, served, first if isinstance(first, list) else [first])
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    writer = _ChunkWriter(head, prompt, params.n, tokens, params.stop, parse_tools, include_usage)

    async def chunks():
        item = first
        try:
            yield writer.start()
            while not isinstance(item, list):
                for chunk in writer.sampled(item):
                    yield chunk
                item = await anext(events)
            if span is not None:
                tracing.set_attributes(span, _response_attributes(served, item, prompt, head))
            for chunk in writer.finish(item, _usage(prompt, item)):
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


def _head(body: ChatCompletionRequest, served: ServedModel, sampled: list[Completion] | list[SampledTokens]) -> dict:
    """The fields every response and chunk starts with. `sampled`: the completions, or a
    stream's first tokens; they say which weights sampled (a training step may have landed
    meanwhile) and, with several engine replicas, which one."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.model,
            "step": next((c.step for c in sampled if c.step is not None), served.step)}
    replica = next((c.replica for c in sampled if c.replica is not None), None)
    if replica is not None:
        head["replica"] = replica
    return head


def _usage(prompt: list[int], completions: list[Completion]) -> dict[str, int]:
    generated = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(prompt), "completion_tokens": generated, "total_tokens": len(prompt) + generated}


def _choice(index: int, c: Completion, prompt: list[int], tokens: _TokenText, parse_tools: bool) -> dict[str, Any]:
    """One non-streamed choice; with `parse_tools`, `<tool_call>` blocks become `tool_calls`."""
    content, calls = split_completion(c.text, parse_tools)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {"index": index, "message": message,
            "finish_reason": "tool_calls" if calls else c.finish_reason,
            "logprobs": {"content": [tokens.entry(c, k) for k in range(len(c.token_ids))]},
            "token_ids": c.token_ids, "prompt_token_ids": prompt}


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
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        # Templates are user-facing programs: whatever they raise on these messages is the
        # messages' problem (or a model without a chat template), never the server's.
        raise ArtValueError(f"the chat template rejected the messages: {type(exc).__name__}: {exc}",
                            "messages") from exc
    # transformers 5 returns a BatchEncoding (a dict); older versions a plain list.
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


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


class _TokenText:
    """Decodes single ids once per response (the `token`/`bytes` of each logprobs entry)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self.cache:
            self.cache[token_id] = self.tokenizer.decode([token_id])
        return self.cache[token_id]

    def item(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": self.bytes(token_id, text)}

    def bytes(self, token_id: int, text: str) -> list[int]:
        """UTF-8 of the text, or the token's raw bytes when it holds part of a character.

        OpenAI's `bytes` exists so clients can rebuild characters split across tokens; the
        decoded text of such a token is U+FFFD, so undo the byte-level BPE alphabet instead.
        """
        if "\ufffd" in text:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in _UNICODE_TO_BYTE for ch in piece):
                return [_UNICODE_TO_BYTE[ch] for ch in piece]
        return list(text.encode("utf-8"))

    def entry(self, c: Completion | SampledTokens, k: int) -> dict[str, Any]:
        top = c.top_logprobs[k] if k < len(c.top_logprobs) else []
        return {**self.item(c.token_ids[k], c.logprobs[k]),
                "top_logprobs": [self.item(t, lp) for t, lp in top]}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values, inverted (char -> byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_level_alphabet()


class _IncrementalText:
    """One choice's text, released token by token, whose deltas concatenate to the engine's text.

    Decoding ids one by one splits multi-byte characters; vLLM's incremental scheme decodes a
    short window and holds text back while it ends in a partial character (U+FFFD). The engine
    cuts a matched stop string from its text, so with `stop` strings the text stops at a match,
    and the last characters wait while a stop string may still complete there. With the
    `final` text known, deltas are clipped to it (it may be shorter than the decode: a stop
    string cut, EOS skipped).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), final: str | None = None) -> None:
        self.tokenizer, self.stop, self.final = tokenizer, stop, final
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.decoded = ""
        self.sent = ""
        self.prefix_offset = self.read_offset = 0

    def add(self, token_id: int) -> str:
        """The delta this token releases (often empty while characters or stop strings wait)."""
        ids = self.ids
        ids.append(token_id)
        prefix = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        new = self.tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=True)
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self.decoded += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        source = self.decoded if self.final is None else self.final
        end = len(self.decoded) - self.hold
        # A match that completes now starts after what was sent (an earlier one would have ended sooner).
        hits = [at for at in (self.decoded.find(s, max(0, len(self.sent) - self.hold)) for s in self.stop) if at >= 0]
        if hits:
            end = min(hits)
        end = max(len(self.sent), min(end, len(source)))
        delta = source[len(self.sent):end]
        self.sent += delta
        return delta

    def rest(self, text: str) -> str:
        """What is left to send of the engine's final `text`."""
        if not text.startswith(self.sent):
            log.warning("streamed text %r is not a prefix of the completion's text %r", self.sent, text)
        return text[len(self.sent):]


class _ChunkWriter:
    """The SSE chunks of one streamed response, built as its tokens arrive.

    Each sampled token is one chunk with its text delta, `logprobs` and `token_ids`; the first
    chunk carries the role and `prompt_token_ids`. A choice whose tools are active sends empty
    content deltas per token and at the end its content once, or its content and its parsed calls
    (`tools.stream_deltas`): finding a call needs the whole text. Finish chunks, usage and
    `[DONE]` follow the completions.
    """

    def __init__(self, head: dict, prompt: list[int], n: int, tokens: _TokenText, stop: tuple[str, ...],
                 parse_tools: bool, include_usage: bool, finals: list[str] | None = None) -> None:
        self.head, self.prompt, self.n, self.tokens = head, prompt, n, tokens
        self.parse_tools, self.include_usage = parse_tools, include_usage
        self.texts = [_IncrementalText(tokens.tokenizer, stop, finals[i] if finals else None) for i in range(n)]

    def sse(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {**self.head, "object": "chat.completion.chunk", "choices": choices, **extra}
        if self.include_usage:
            chunk.setdefault("usage", None)
        return f"data: {json.dumps(chunk)}\n\n"

    def start(self) -> str:
        first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None, "prompt_token_ids": self.prompt} for i in range(self.n)]
        return self.sse(first, prompt_token_ids=self.prompt)

    def sampled(self, sampled: SampledTokens) -> Iterator[str]:
        text = self.texts[sampled.index]
        for k, token_id in enumerate(sampled.token_ids):
            delta = "" if self.parse_tools else text.add(token_id)
            yield self.sse([{"index": sampled.index, "delta": {"content": delta},
                             "logprobs": {"content": [self.tokens.entry(sampled, k)]},
                             "finish_reason": None, "token_ids": [token_id]}])

    def finish(self, completions: list[Completion], usage: dict[str, int]) -> Iterator[str]:
        for i, c in enumerate(completions):
            content, calls = split_completion(c.text, self.parse_tools)
            if calls:
                deltas = stream_deltas(content, calls)
            else:
                rest = c.text if self.parse_tools else self.texts[i].rest(c.text)
                deltas = [{"content": rest}] if rest else []
            for delta in deltas:
                yield self.sse([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            finish = "tool_calls" if calls else c.finish_reason
            yield self.sse([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}])
        if self.include_usage:
            yield self.sse([], usage=usage)
        yield "data: [DONE]\n\n"


# -- errors ------------------------------------------------------------------------------


class AsciiJSONResponse(JSONResponse):
    """Error bodies as ASCII JSON: no text a request sent (a lone surrogate) can break them."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False).encode()


def _error(status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return AsciiJSONResponse(body, status_code=status)


def error_response(body: dict[str, Any]) -> JSONResponse:
    """An `error_object` as the response (its `status` becomes the HTTP status, its
    `retry_after` a Retry-After header)."""
    status = body.pop("status")
    headers = {"Retry-After": str(body["retry_after"])} if body.get("retry_after") is not None else None
    return AsciiJSONResponse({"error": body}, status_code=status, headers=headers)


def internal_error(exc: BaseException, what: str = "request") -> dict[str, Any]:
    """The error object of an unexpected failure: no exception text leaves the server. Its
    `request_id` is the one on the server's log line, which has the traceback."""
    request_id = uuid.uuid4().hex[:16]
    log.error("%s failed [request_id %s]: %s: %s", what, request_id, type(exc).__name__, exc, exc_info=exc)
    return {"message": f"internal error (request_id {request_id}): the server's log has the details",
            "type": "server_error", "param": None, "code": "internal_error", "request_id": request_id,
            "status": 500}


def error_object(exc: BaseException, what: str = "request") -> dict[str, Any]:
    """OpenAI's error object for `exc`, with the HTTP `status` it is answered with (the one
    mapping of `art.errors` to HTTP; `art.RemoteBackend` inverts it). Failures that are not
    the library's own errors are logged with a request id and answered with only that id."""
    extra: dict[str, Any] = {}
    if isinstance(exc, ModelNotFoundError):
        status, kind, param, code = 404, "invalid_request_error", "model", "model_not_found"
    elif isinstance(exc, ArtValueError):
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        field = getattr(exc, "field", None)
        status, kind, param = 400, "invalid_request_error", field if isinstance(field, str) else None
    elif isinstance(exc, StepConflictError):
        status, kind, param, code = 409, "invalid_request_error", "expected_step", "step_conflict"
        extra = {"expected_step": exc.expected_step, "current_step": exc.current_step}
    elif isinstance(exc, StepCancelledError):
        status, kind, param, code = 409, "invalid_request_error", None, "step_cancelled"
    elif isinstance(exc, BackendUnavailableError):  # stopped, restarting, shutting down: worth sending again
        status, kind, param, code = 503, "server_error", None, "unavailable"
        extra = {"retry_after": exc.retry_after}
    elif isinstance(exc, ArtError):  # the library's own message, written for the user
        request_id = uuid.uuid4().hex[:16]
        log.error("%s failed [request_id %s]: %s", what, request_id, exc)
        status, kind, param, code = 500, "server_error", None, None
        extra = {"request_id": request_id}
    else:
        return internal_error(exc, what)
    return {"message": str(exc), "type": kind, "param": param, "code": code, **extra, "status": status}


def _loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; ('query', 'x') -> 'x'."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            ctx = (detail.get("ctx") or {}).get("error", "")
            return _error(400, f"malformed JSON body: {ctx}".rstrip(": "),
                          "invalid_request_error", None, "invalid_json")
        if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        parts = []
        for e in errors[:5]:
            where = _loc(tuple(e.get("loc", ()))) or "body"
            value = e.get("input")
            got = f" (got {echo(value)})" if isinstance(value, (int, float, str, bool)) else ""
            parts.append(f"{where}: {e.get('msg', 'invalid')}{got}")
        param = _loc(tuple(errors[0].get("loc", ()))) if errors else None
        return _error(400, "invalid request: " + "; ".join(parts), "invalid_request_error", param)

    @app.exception_handler(ArtError)
    async def art_error(request: Request, exc: ArtError) -> JSONResponse:
        return error_response(error_object(exc, f"{request.method} {request.url.path}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A backstop: Starlette still re-raises to the ASGI server after this response; the
        # routes themselves answer their own failures without re-raising.
        return error_response(internal_error(exc, f"{request.method} {request.url.path}"))
