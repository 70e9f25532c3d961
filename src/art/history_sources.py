"""Where each item of a history came from, and how a trajectory's exchanges grow branches.

The source records (`ChatCompletionsMessageSource`, ...) point an item of a history at the
exchange it came from and where in it; `select` picks the exchanges `model=` names; `grow` adds
one call to the branches exchanges have grown so far (each branch left at the end is a history).
`art.histories` builds each API's histories on these.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any

from .exchanges import ChatCompletionsExchange, CompletionsExchange, MessagesExchange, ResponsesExchange

# -- sources ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatCompletionsMessageSource:
    """Where a chat message came from: item `request_index` of the exchange's request, or its
    choice `choice_index` (a Messages or Responses exchange converted to chat: `output_index`)."""

    exchange: ChatCompletionsExchange | MessagesExchange | ResponsesExchange
    request_index: int | None = None
    choice_index: int | None = None
    output_index: int | None = None
    generation_index: int | None = None


@dataclass(frozen=True)
class AnthropicMessageSource:
    """Message `request_index` of the request, or (None) the exchange's response."""

    exchange: MessagesExchange
    request_index: int | None = None


@dataclass(frozen=True)
class ResponsesItemSource:
    """Input item `request_index` of the request, or output item `output_index` of the response
    (`generation_index`: which of its token generations sampled it)."""

    exchange: ResponsesExchange
    request_index: int | None = None
    output_index: int | None = None
    generation_index: int | None = None


@dataclass(frozen=True)
class CompletionsSource:
    """Prompt `prompt_index` of a Completions request, or (with `choice_index`) what that choice sampled."""

    exchange: CompletionsExchange
    prompt_index: int
    choice_index: int | None = None


@dataclass(frozen=True)
class CompletionsTokenSourceSpan:
    """Token positions [start, end) of a token history and their source (None: user-written)."""

    start: int
    end: int
    source: CompletionsSource | None


@dataclass(frozen=True)
class CompletionsStringSourceSpan:
    """Character positions [start, end) of a string history and their source (None: user-written)."""

    start: int
    end: int
    source: CompletionsSource | None


# -- model selection -------------------------------------------------------------------------


def model_selected(name: str | None, model: str | None, exact: bool) -> bool:
    """Whether `model=` selects an exchange of model `name`: every one when None, else by exact
    name (`exact`: some exchange has that name) or as an `fnmatch` pattern."""
    if model is None:
        return True
    return name == model if exact else name is not None and (name == model or fnmatchcase(name, model))


def select(exchanges: Sequence[Any], model: str | None, protocol: str) -> list[tuple[str, list[Any]]]:
    """(model, its exchanges in start order) for each model `model=` selects: its exact name when
    some exchange has it, else an `fnmatch` pattern (`"policy@*"`); every model when None."""
    exact = model is not None and any(e.model == model for e in exchanges)
    chosen = [e for e in exchanges if model_selected(e.model, model, exact)]
    if not chosen:
        raise ValueError(
            f"Trajectory contains no {protocol} exchanges" + (f" for model {model!r}" if model is not None else "")
        )
    if any(e.model is None for e in chosen):
        raise ValueError(f"Every {protocol} exchange must identify its model")
    by_model: dict[str, list[Any]] = {}
    for exchange in sorted(chosen, key=lambda e: (e.start_time, e.end_time)):
        by_model.setdefault(exchange.model, []).append(exchange)
    return list(by_model.items())


def only(histories: Sequence[Any], what: str, model: str | None) -> Any:
    if model is None and len({getattr(h, "model", None) for h in histories if hasattr(h, "protocol")}) > 1:
        raise ValueError(f"{what} requires exactly one model; pass model= to select one")
    if len(histories) != 1:
        raise ValueError(f"{what} requires exactly one history; found {len(histories)}")
    return histories[0]


# -- branches --------------------------------------------------------------------------------


@dataclass
class Branch:
    items: list[Any]
    keys: list[str]  # one per item: what must agree for a later request to continue it
    lineage: list[str]  # one per item: the same, without hidden reasoning (which sources it)
    sources: list[Any]
    context: str  # the request's tools, system prompt, template, as JSON
    order: tuple[int, ...]
    first_time: datetime
    context_source: Any = None


def json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def lineage_sources(branches: list[Branch], lineage: list[str], defaults: list[Any]) -> list[Any]:
    """Sources for a request's items: those of the longest branch (any context) whose items the
    request repeats (reasoning aside), the request's own for the rest."""
    parents = [b for b in branches if len(b.items) < len(lineage) and lineage[: len(b.items)] == b.lineage]
    if not parents:
        return list(defaults)
    parent = min(parents, key=lambda b: (-len(b.items), b.order))
    return [*parent.sources, *defaults[len(parent.items) :]]


@dataclass
class Call:
    """One request's prompt and the outputs it sampled, in one API's items."""

    prompt: list[Any]
    keys: list[str]
    lineage: list[str]
    sources: list[Any]
    outputs: list[tuple[int, list[Any], list[str], list[str], list[Any]]]  # (index, items, keys, lineage, sources)
    context: str
    sequence: int
    start_time: datetime
    context_source: Any = None


def grow(branches: list[Branch], call: Call, continues: Callable[[Branch], bool] | None = None) -> None:
    """Extend the longest branch the call's prompt begins with (or share the sources of one it
    regenerates, or start anew): one new branch per output."""
    n = len(call.prompt)
    fits = [
        b
        for b in branches
        if b.context == call.context
        and len(b.keys) <= n
        and call.keys[: len(b.keys)] == b.keys
        and (continues is None or continues(b))
    ]
    parent, removed = None, False
    if fits:
        parent = min(fits, key=lambda b: (-len(b.items), b.order))
        branches.remove(parent)
        removed = True
        sources = [*parent.sources, *call.sources[len(parent.items) :]]
    else:
        redone = [
            b
            for b in branches
            if b.context == call.context
            and len(b.keys) >= n
            and b.keys[:n] == call.keys
            and (continues is None or continues(b))
        ]
        parent = min(redone, key=lambda b: b.order) if redone else None
        sources = list(parent.sources[:n]) if parent else list(call.sources)
    order = parent.order if parent else (call.sequence,)
    first = parent.first_time if parent else call.start_time
    for index, items, keys, lineage, out_sources in call.outputs:
        branches.append(
            Branch(
                [*copy.deepcopy(call.prompt), *copy.deepcopy(items)],
                [*call.keys, *keys],
                [*call.lineage, *lineage],
                [*sources, *out_sources],
                call.context,
                (*order, index),
                first,
                call.context_source,
            )
        )
    if not call.outputs and removed and parent is not None:
        branches.append(parent)


def finished(branches: list[Branch]) -> list[Branch]:
    return sorted(branches, key=lambda b: (b.first_time, b.order))
