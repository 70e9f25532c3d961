"""A Responses exchange as one call of the branches `art.histories` grows (`art.histories` explains
histories): its input items, with the items an earlier call left when the request names it by
`previous_response_id` or `conversation`, its output items with the generation that sampled each,
and the context (instructions, tools, conversation, template) a branch must share."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from art.types import as_dict

from .exchange_tokens import responses_generations
from .exchanges import ResponsesExchange
from .history_sources import Branch, Call, ResponsesItemSource, json_key, lineage_sources

Thread = tuple[list[Any], list[Any], Any, str | None]
"""What a later call's `previous_response_id` or `conversation` brings back: (items, sources,
conversation, previous id outside the trajectory)."""


def responses_input(value: Any) -> list[dict[str, Any]]:
    """A request's `input` as items (text is one user message), so each item can have a source."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise ValueError("Responses input must be text or a list of input items")
    return [copy.deepcopy(dict(item)) for item in value]


def responses_output_items(exchange: ResponsesExchange) -> list[dict[str, Any]]:
    """A response's output items as the JSON objects a history holds."""
    return [as_dict(item, mode="json", exclude_none=True) for item in exchange.response.output or []]


def _generation_of(exchange: ResponsesExchange) -> dict[int, int]:
    """Which generation sampled each output item, so a history can point its tokens at it."""
    generation_of: dict[int, int] = {}
    for number, (sampled, indices) in enumerate(responses_generations(exchange)):
        if sampled.prompt_ids is None:
            raise ValueError("Responses generation without an exact prompt cannot be projected")
        if sampled.token_ids is None:
            raise ValueError("Responses generation without exact output tokens cannot yet be projected as a history")
        generation_of.update({index: number for index in indices})
    return generation_of


class ResponsesThreads:
    """The calls of one model so far, so that a later call that names one brings its items back."""

    def __init__(self) -> None:
        self._earlier: dict[str, Thread] = {}
        self._conversations: dict[str, Thread] = {}

    def call(self, exchange: ResponsesExchange, sequence: int, branches: list[Branch]) -> Call:
        """The exchange as the `Call` that grows `branches`, remembered for the calls after it."""
        request = exchange.request
        prompt, sources, conversation, outside = self._prompt(exchange)
        keys = [json_key(item) for item in prompt]
        sources = lineage_sources(branches, keys, sources)
        instructions = request.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ValueError("Responses instructions must be text")
        output = responses_output_items(exchange)
        generation_of = _generation_of(exchange)
        out_sources = [
            ResponsesItemSource(exchange, output_index=i, generation_index=generation_of.get(i))
            for i in range(len(output))
        ]
        out_keys = [json_key(item) for item in output]
        context = json_key(
            [
                instructions,
                request.get("tools"),
                conversation,
                outside,
                request.get("chat_template"),
                request.get("chat_template_kwargs"),
            ]
        )
        record = ([*prompt, *output], [*sources, *out_sources], copy.deepcopy(conversation), outside)
        self._earlier[exchange.response.id] = record
        if conversation is not None:
            self._conversations[json_key(conversation)] = record
        return Call(
            prompt,
            keys,
            keys,
            sources,
            [(0, output, out_keys, out_keys, out_sources)],
            context,
            sequence,
            exchange.start_time,
            exchange if instructions is not None else None,
        )

    def _prompt(self, exchange: ResponsesExchange) -> tuple[list[Any], list[Any], Any, str | None]:
        """The request's input after the items of the call it continues, so the history holds the
        whole conversation: (items, sources, conversation, previous id outside the trajectory)."""
        request = exchange.request
        prompt = responses_input(request.get("input"))
        sources: list[Any] = [ResponsesItemSource(exchange, request_index=i) for i in range(len(prompt))]
        previous, conversation = request.get("previous_response_id"), request.get("conversation")
        prior = self._earlier.get(previous) if isinstance(previous, str) else None
        if prior is None and conversation is not None:
            prior = self._conversations.get(json_key(conversation))
        outside = previous if isinstance(previous, str) and previous not in self._earlier else None
        if prior is None:
            return prompt, sources, conversation, outside
        items, earlier_sources, inherited, earlier_outside = prior
        return (
            [*copy.deepcopy(items), *prompt],
            [*earlier_sources, *sources],
            conversation if conversation is not None else inherited,
            outside or earlier_outside,
        )
