"""The exact token ids a server reported with an exchange: what a call's prompt was and what it sampled.

vLLM and our server answer with `prompt_token_ids`, the sampled `token_ids` and per-token logprobs
beside each API's own fields: on a chat choice (or the chat completion), on a Completions choice,
at the top of an Anthropic `Message`, at the top of a `Response` (ours) or as ART's
`token_generations` (several sampling steps of one response, each claiming output items). Ids may
be ints or vLLM's `"token_id:N"` strings. Readers here return them as `Sampled`; malformed ids
raise ValueError. A history's source (`art.histories`) names its exchange and the choice, output
or generation it points at; `sampled_of` reads that one. Nothing here builds histories or tokenizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from art.numeric import is_int

from .exchanges import ChatCompletionsExchange, CompletionsExchange, MessagesExchange, ResponsesExchange


@dataclass(frozen=True)
class Sampled:
    """What one sampling step saw and produced, as the server reported it (None: not reported)."""

    prompt_ids: list[int] | None
    token_ids: list[int] | None
    logprobs: list[float] | None  # one per token id, or None
    prompt_logprobs: list[float] | None = None  # an echoed prompt's, one per prompt id


def token_ids(value: Any, where: str) -> list[int] | None:
    """A list of exact token ids (ints or vLLM's "token_id:N" strings); ValueError when malformed."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"{where}: exact token metadata must be a list")
    out = []
    for item in value:
        if isinstance(item, str) and item.startswith("token_id:") and item[9:].isdigit():
            item = int(item[9:])
        if not is_int(item) or item < 0:
            raise ValueError(f"{where} contains an invalid exact token ID: {item!r}")
        out.append(item)
    return out


def extra_fields(model: Any) -> dict[str, Any]:
    return dict(getattr(model, "model_extra", None) or {})


def chat_logprobs(logprobs: Any) -> list[float] | None:
    content = getattr(logprobs, "content", None) if not isinstance(logprobs, Mapping) else logprobs.get("content")
    if not content:
        return None
    values = [
        entry.get("logprob") if isinstance(entry, Mapping) else getattr(entry, "logprob", None) for entry in content
    ]
    return _floats(values)


def chat_sampled(exchange: ChatCompletionsExchange, choice_index: int) -> Sampled:
    choice = next((c for c in exchange.response.choices if c.index == choice_index), None)
    if choice is None:
        raise ValueError(f"Chat Completions source choice {choice_index} is out of bounds")
    extra, top = extra_fields(choice), extra_fields(exchange.response)
    prompt = extra.get("prompt_token_ids", top.get("prompt_token_ids"))
    return Sampled(
        token_ids(prompt, "prompt_token_ids"),
        token_ids(extra.get("token_ids"), "token_ids"),
        chat_logprobs(choice.logprobs),
    )


def messages_sampled(exchange: MessagesExchange) -> Sampled:
    extra = extra_fields(exchange.response)
    values = extra.get("logprobs")
    if isinstance(values, Mapping):
        values = chat_logprobs(values)
    elif isinstance(values, list):
        values = [float(v) for v in values] if all(isinstance(v, (int, float)) for v in values) else None
    return Sampled(
        token_ids(extra.get("prompt_token_ids"), "prompt_token_ids"),
        token_ids(extra.get("token_ids"), "token_ids"),
        values,
    )


def responses_generations(exchange: ResponsesExchange) -> list[tuple[Sampled, list[int]]]:
    """Each token generation of a response with the output items it sampled: ART's
    `token_generations`, or our server's one generation (`prompt_token_ids`, `token_ids`)."""
    extra = extra_fields(exchange.response)
    outputs = len(exchange.response.output or [])
    generations = extra.get("token_generations")
    if isinstance(generations, list):
        out = []
        for i, generation in enumerate(generations):
            generation = generation if isinstance(generation, Mapping) else {}
            tokens = generation.get("output_tokens")
            ids = logprobs = None
            if isinstance(tokens, list):
                ids = token_ids(
                    [t.get("token_id") if isinstance(t, Mapping) else t for t in tokens],
                    f"token_generations[{i}].output_tokens",
                )
                values = [t.get("logprob") if isinstance(t, Mapping) else None for t in tokens]
                logprobs = _floats(values)
            indices = [i for i in generation.get("output_indices") or [] if isinstance(i, int)]
            out.append(
                (Sampled(token_ids(generation.get("prompt_token_ids"), "prompt_token_ids"), ids, logprobs), indices)
            )
        claimed = [i for _, indices in out for i in indices]
        if len(claimed) != len(set(claimed)):
            raise ValueError("Responses token generations must claim nonoverlapping output items")
        if out and sorted(claimed) != list(range(outputs)):
            raise ValueError("Responses token generations must cover every sampled output item")
        return out
    if extra.get("token_ids") is None and extra.get("prompt_token_ids") is None:
        return []
    return [
        (
            Sampled(
                token_ids(extra.get("prompt_token_ids"), "prompt_token_ids"),
                token_ids(extra.get("token_ids"), "token_ids"),
                chat_logprobs(extra.get("logprobs")),
            ),
            list(range(outputs)),
        )
    ]


def completion_sampled(exchange: CompletionsExchange, choice_index: int) -> Sampled:
    choice = next((c for c in exchange.response.choices if c.index == choice_index), None)
    if choice is None:
        raise ValueError(f"Completions source choice {choice_index} is out of bounds")
    extra = extra_fields(choice)
    ids = token_ids(extra.get("token_ids"), "Completions token_ids")
    prompt = token_ids(extra.get("prompt_token_ids"), "Completions prompt_token_ids")
    logprobs = getattr(choice, "logprobs", None)
    given: list[Any] = list(getattr(logprobs, "token_logprobs", None) or [])
    echoed = None
    echo = exchange.request.get("echo") is True
    if echo and ids is not None and prompt is not None and len(given) == len(prompt) + len(ids):
        head, given = given[: len(prompt)], given[len(prompt) :]  # an echoed prompt's logprobs come first
        echoed = [float(v) if isinstance(v, (int, float)) else math.nan for v in head]
    values = _floats(given) if given else None
    if ids is not None and values is not None and len(values) != len(ids):
        values = None
    return Sampled(prompt, ids, values, echoed)


def is_sampled(source: Any) -> bool:
    """A source that points at what the model sampled (not at a request's items)."""
    if source is None:
        return False
    if getattr(source, "choice_index", None) is not None or getattr(source, "output_index", None) is not None:
        return True
    # an Anthropic message source (no output_index field) of the response, not of the request
    return (
        isinstance(source.exchange, MessagesExchange)
        and not hasattr(source, "output_index")
        and source.request_index is None
    )


def sampled_of(source: Any) -> tuple[Any, Sampled | None]:
    """(identity of the sampling step, its exact evidence or None) for a sampled chat source."""
    exchange = source.exchange
    if isinstance(exchange, ChatCompletionsExchange):
        return (id(exchange), source.choice_index), chat_sampled(exchange, source.choice_index)
    if isinstance(exchange, MessagesExchange):
        return (id(exchange), 0), messages_sampled(exchange)
    generations = responses_generations(exchange)
    number = source.generation_index if source.generation_index is not None else (0 if len(generations) == 1 else None)
    if number is None or not 0 <= number < len(generations):
        return (id(exchange), source.output_index), None
    return (id(exchange), "g", number), generations[number][0]


def _floats(values: list[Any]) -> list[float] | None:
    """The values as floats when every one is a number (the sampler's logprobs), else None."""
    if not all(isinstance(v, (int, float)) for v in values):
        return None
    return [float(v) for v in values]
