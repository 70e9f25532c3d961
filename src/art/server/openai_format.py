"""OpenAI's response shapes from an engine's completions: the JSON of a chat completion, the SSE
chunks of a stream, and the tool calls parsed out of a completion's text.

Every choice carries, beside OpenAI's fields, what RL training needs: its exact completion
`token_ids`, the `prompt_token_ids` (vLLM's `return_token_ids` names), per-token logprobs and
vLLM's `stop_reason` (the stop string that ended it, else None: `matched_stop`). Parsing
`<tool_call>` blocks (the Hermes convention the prompt offers, `art.chat_template`) changes only
the text fields: the ids and logprobs stay exactly as sampled. The GenAI
span attributes of a request and its response are written here too. Nothing here knows
routes, registries or sampling.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import Iterator
from typing import Any

from art.chat_template import CLOSE, OPEN
from art.engine.base import Completion, SampledTokens, SamplingParams, ServedModel
from art.server import harmony
from art.server.openai_schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)


# -- span attributes -----------------------------------------------------------------------


def request_attributes(body: ChatCompletionRequest) -> dict[str, Any]:
    """GenAI semantic-convention attributes of a chat request (and what Phoenix reads)."""
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "art",
        "gen_ai.request.model": body.model,
        "gen_ai.request.temperature": body.temperature,
        "gen_ai.request.top_p": body.top_p,
        "gen_ai.request.max_tokens": body.requested_max_tokens,
        "gen_ai.request.choice.count": body.n,
        "gen_ai.request.seed": body.seed,
        "openinference.span.kind": "LLM",
        "llm.model_name": body.model,
        "langfuse.observation.type": "generation",
        "input.value": json.dumps([m.for_template() for m in body.messages], default=str, ensure_ascii=False),
        "input.mime_type": "application/json",
    }


def response_attributes(
    served: ServedModel, completions: list[Completion], prompt: list[int], head: dict
) -> dict[str, Any]:
    first = completions[0] if completions else None
    prompt_tokens, generated = len(prompt), sum(len(c.token_ids) for c in completions)
    return {
        "gen_ai.response.id": head["id"],
        "gen_ai.response.model": served.name,
        "gen_ai.response.finish_reasons": [c.finish_reason for c in completions],
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": generated,
        "llm.token_count.prompt": prompt_tokens,
        "llm.token_count.completion": generated,
        "art.step": head["step"],
        "art.adapter": served.adapter.key if served.adapter else None,
        "art.queue_time_s": first.queue_s if first else None,
        "art.time_to_first_token_s": first.time_to_first_token_s if first else None,
        "output.value": json.dumps([c.text for c in completions], ensure_ascii=False),
        "gen_ai.completion": json.dumps([c.text for c in completions], ensure_ascii=False),
    }


# -- responses ----------------------------------------------------------------------------


def response_head(
    body: ChatCompletionRequest | CompletionRequest,
    served: ServedModel,
    sampled: list[Completion] | list[SampledTokens],
) -> dict:
    """The fields every response and chunk starts with. `sampled`: the completions, or a
    stream's first tokens; they say which weights sampled (a training step may have landed
    meanwhile) and, with several engine replicas, which one."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.model,
        "step": next((c.step for c in sampled if c.step is not None), served.step),
    }
    replica = next((c.replica for c in sampled if c.replica is not None), None)
    if replica is not None:
        head["replica"] = replica
    return head


def token_usage(prompt: list[int], completions: list[Completion]) -> dict[str, int]:
    generated = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(prompt), "completion_tokens": generated, "total_tokens": len(prompt) + generated}


def matched_stop(tokenizer, c: Completion, stop: tuple[str, ...]) -> str | None:
    """vLLM's `stop_reason`: the stop string that ended `c`, None when EOS or the length did.

    The engine cuts a matched stop string from the text but keeps its ids, so the full decode
    holds it right where the text ends; of several starting there, the shortest completed first."""
    if c.finish_reason != "stop" or not stop:
        return None
    whole = tokenizer.decode(c.token_ids, skip_special_tokens=True)
    hits = [s for s in stop if whole.startswith(s, len(c.text))]
    return min(hits, key=len) if hits else None


def response_choice(
    index: int, c: Completion, prompt: list[int], tokens: TokenText, parse_tools: bool, stop: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One non-streamed choice; with `parse_tools`, `<tool_call>` blocks (or harmony's calls)
    become `tool_calls`; harmony's analysis channel becomes `reasoning`."""
    content, reasoning, calls = split_reply(tokens, c, parse_tools)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message.update(reasoning_fields(reasoning))
    if calls:
        message["tool_calls"] = calls
    choice = {
        "index": index,
        "message": message,
        "finish_reason": "tool_calls" if calls else c.finish_reason,
        "stop_reason": None if calls else matched_stop(tokens.tokenizer, c, stop),
        "logprobs": {"content": [tokens.entry(c, k) for k in range(len(c.token_ids))]},
        "token_ids": c.token_ids,
        "prompt_token_ids": prompt,
    }
    if c.step is not None:  # the choice itself says which weights sampled it: a trajectory keeps only choices
        choice["step"] = c.step
    return choice


def split_reply(tokens: TokenText, c: Completion, parse_tools: bool) -> tuple[str | None, str | None, list[dict]]:
    """(content, reasoning, tool calls) of a completion: harmony's channels for a tokenizer that
    speaks it (gpt-oss), else the text and, with `parse_tools`, its `<tool_call>` blocks."""
    if tokens.harmony:
        reply = harmony.parse(tokens.tokenizer.decode(c.token_ids, skip_special_tokens=False))
        return reply.content, reply.reasoning, reply.calls if parse_tools else []
    content, calls = split_completion(c.text, parse_tools)
    return content, None, calls


@functools.lru_cache(maxsize=16)
def _speaks_harmony(tokenizer) -> bool:
    return harmony.speaks_harmony(tokenizer)  # reads the whole vocabulary: once per tokenizer


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A message's reasoning under vLLM's name (`reasoning`) and the older one clients still read
    (`reasoning_content`, which vLLM also accepted until it renamed it)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


class TokenText:
    """Decodes single ids once per response (the `token`/`bytes` of each logprobs entry)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.harmony = _speaks_harmony(tokenizer)
        """Replies are harmony messages (gpt-oss): parsed by channel, not streamed as text."""

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
        return {**self.item(c.token_ids[k], c.logprobs[k]), "top_logprobs": [self.item(t, lp) for t, lp in top]}


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


class IncrementalText:
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
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        new = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self.decoded += new[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        source = self.decoded if self.final is None else self.final
        end = len(self.decoded) - self.hold
        # A match that completes now starts after what was sent (an earlier one would have ended sooner).
        hits = [at for at in (self.decoded.find(s, max(0, len(self.sent) - self.hold)) for s in self.stop) if at >= 0]
        if hits:
            end = min(hits)
        end = max(len(self.sent), min(end, len(source)))
        delta = source[len(self.sent) : end]
        self.sent += delta
        return delta

    def rest(self, text: str) -> str:
        """What is left to send of the engine's final `text`."""
        if not text.startswith(self.sent):
            log.warning("streamed text %r is not a prefix of the completion's text %r", self.sent, text)
        return text[len(self.sent) :]


class ChunkWriter:
    """The SSE chunks of one streamed response, built as its tokens arrive.

    Each sampled token is one chunk with its text delta, `logprobs` and `token_ids`; the first
    chunk carries the role and `prompt_token_ids`. A choice whose tools are active sends empty
    content deltas per token and at the end its content once, or its content and its parsed calls
    (`stream_deltas`): finding a call needs the whole text. Finish chunks (with `stop_reason`),
    usage and `[DONE]` follow the completions.
    """

    def __init__(
        self,
        head: dict,
        prompt: list[int],
        n: int,
        tokens: TokenText,
        stop: tuple[str, ...],
        parse_tools: bool,
        include_usage: bool,
        finals: list[str] | None = None,
    ) -> None:
        self.head, self.prompt, self.n, self.tokens, self.stop = head, prompt, n, tokens, stop
        self.parse_tools, self.include_usage = parse_tools, include_usage
        self.texts = [IncrementalText(tokens.tokenizer, stop, finals[i] if finals else None) for i in range(n)]

    def sse(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {**self.head, "object": "chat.completion.chunk", "choices": choices, **extra}
        if self.include_usage:
            chunk.setdefault("usage", None)
        return f"data: {json.dumps(chunk)}\n\n"

    def start(self) -> str:
        first = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
                "prompt_token_ids": self.prompt,
            }
            for i in range(self.n)
        ]
        return self.sse(first, prompt_token_ids=self.prompt)

    @property
    def buffered(self) -> bool:
        """Text deltas wait for the end: a call, or a harmony channel, needs the whole reply."""
        return self.parse_tools or self.tokens.harmony

    def sampled(self, sampled: SampledTokens) -> Iterator[str]:
        text = self.texts[sampled.index]
        for k, token_id in enumerate(sampled.token_ids):
            delta = "" if self.buffered else text.add(token_id)
            yield self.sse(
                [
                    {
                        "index": sampled.index,
                        "delta": {"content": delta},
                        "logprobs": {"content": [self.tokens.entry(sampled, k)]},
                        "finish_reason": None,
                        "token_ids": [token_id],
                    }
                ]
            )

    def finish(self, completions: list[Completion], usage: dict[str, int]) -> Iterator[str]:
        for i, c in enumerate(completions):
            content, reasoning, calls = split_reply(self.tokens, c, self.parse_tools)
            deltas: list[dict[str, Any]] = [reasoning_fields(reasoning)] if reasoning is not None else []
            if calls:
                deltas += stream_deltas(content, calls)
            elif self.tokens.harmony:
                deltas += [{"content": content}] if content else []
            else:
                rest = c.text if self.parse_tools else self.texts[i].rest(c.text)
                deltas += [{"content": rest}] if rest else []
            for delta in deltas:
                yield self.sse([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            finish = "tool_calls" if calls else c.finish_reason
            stop_reason = None if calls else matched_stop(self.tokens.tokenizer, c, self.stop)
            yield self.sse(
                [{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}]
            )
        if self.include_usage:
            yield self.sse([], usage=usage)
        yield "data: [DONE]\n\n"


# -- tool calls in a completion ------------------------------------------------------------


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a completion into its content and OpenAI tool calls. Never raises.

    Every `<tool_call>...</tool_call>` block whose body is a JSON object (whitespace and a
    ```json fence around it are tolerated) with a string `name` and `arguments` given as an
    object or a JSON string of one (absent means `{}`) becomes
    `{"id": "call_<hex>", "type": "function", "function": {"name", "arguments": <JSON string>}}`.
    The last block may lack `</tool_call>` (cut by EOS, a stop string or max_tokens) if its
    JSON is complete. Blocks that do not parse stay in the content, which is the text outside
    parsed blocks, stripped, or None when nothing is left.
    """
    try:
        return _parse(text)
    except Exception:  # a parsing bug must not lose the completion
        log.exception("tool call parsing failed; the completion is returned as content")
        return (text.strip() or None) if isinstance(text, str) else None, []


def _parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    kept: list[str] = []
    calls: list[dict[str, Any]] = []
    pos = 0
    while (start := text.find(OPEN, pos)) != -1:
        body_start = start + len(OPEN)
        close = text.find(CLOSE, body_start)
        reopen = text.find(OPEN, body_start)
        if close != -1 and (reopen == -1 or close < reopen):
            body, end = text[body_start:close], close + len(CLOSE)
        elif reopen == -1:  # the final block, cut off before its closing tag
            body, end = text[body_start:], len(text)
        else:  # an unclosed block followed by another one: malformed, stays content
            kept.append(text[pos:reopen])
            pos = reopen
            continue
        call = _call(body)
        if call is None:
            kept.append(text[pos:end])
        else:
            kept.append(text[pos:start])
            calls.append(call)
        pos = end
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return content or None, calls


def _call(body: str) -> dict[str, Any] | None:
    body = body.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    arguments = obj.get("arguments", {})
    if not isinstance(name, str) or not name.strip():
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def split_completion(text: str, active: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a completion: `(text, [])` unless tools are active and it parses."""
    if not active:
        return text, []
    content, calls = parse_tool_calls(text)
    return (content, calls) if calls else (text, [])


def stream_deltas(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stream deltas of a choice with tool calls: its content once, then each call whole
    (OpenAI's `delta.tool_calls` shape: index, id, type, function name and arguments).
    Empty without calls: such a choice streams its text token by token instead."""
    if not calls:
        return []
    deltas: list[dict[str, Any]] = [{"content": content}] if content else []
    deltas += [{"tool_calls": [{"index": j, **call}]} for j, call in enumerate(calls)]
    return deltas


def body_sampling(body: Any, **rest: Any) -> SamplingParams:
    """The sampling fields a chat and a completions request share (OpenAI's and vLLM's names; a
    negative top_k is vLLM's "off"), plus the fields only one of them sets (`rest`)."""
    return SamplingParams(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        stop=body.stop_strings,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        **rest,
    )
