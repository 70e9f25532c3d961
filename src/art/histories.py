"""A trajectory's exchanges as histories: the conversations its model calls formed, one API at a time.

ART's 2026 names. A history is a mutable dataclass in its API's own terms (chat messages, Anthropic
messages, Responses input items, Completions prompt ids or text) beside a parallel list of
*sources*: for each item, the exchange it came from and where in it (`request_index` for an item
of a request, `choice_index` / `output_index` / `generation_index` for what the model sampled),
or None for an item a user wrote. Tokenizing (`art.tokenize`) reads exact token ids through the
sources, and refuses an item that no longer matches its source.

How exchanges become histories. Exchanges of one model, in start order, grow *branches*: a call
whose request (items, and its context: tools, system prompt, chat template) begins with a
branch's items extends the longest such branch with its answer, one branch per choice; a call
that extends none starts a branch (a request that is a prefix of a branch is a regeneration and
shares that branch's sources). Each branch left at the end is a history. Unlike ART, which splits
only where a template dropped a sampled turn's reasoning, a branch (Chat, Messages, Responses) also
ends wherever the next call's exact prompt ids do not extend the ids sampled so far (a template
that re-renders earlier turns): our trainer trains that as a new token sequence, so each history
is one sequence. `model=` selects exchanges by model name or `fnmatch` pattern.

Nothing here tokenizes (`art.exchange_tokens` reads the ids), knows trajectories' classes (a
trajectory is read by its attributes) or imports `art.tokenize`, which imports this module:
`History.tokenize` goes through `TOKENIZE_HOOK`, which `art.tokenize` fills.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from art.numeric import is_int
from art.types import as_dict

from .exchange_tokens import (
    Sampled,
    chat_sampled,
    is_sampled,
    messages_sampled,
    responses_generations,
    sampled_of,
)
from .exchange_turns import anthropic_chat_messages, anthropic_chat_tools
from .exchanges import (
    ChatCompletionsExchange,
    MessagesExchange,
    ResponsesExchange,
    TrajectoryExchanges,
)
from .history_sources import (
    AnthropicMessageSource,
    Branch,
    Call,
    ChatCompletionsMessageSource,
    CompletionsSource,
    CompletionsStringSourceSpan,
    CompletionsTokenSourceSpan,
    ResponsesItemSource,
    finished,
    grow,
    json_key,
    lineage_sources,
    only,
    select,
)
from .responses_calls import (  # responses_input and responses_output_items: re-exported for `art.tokenize`
    ResponsesThreads,
    responses_input as responses_input,
    responses_output_items as responses_output_items,
)
from .responses_format import ResponsesFormatError, chat_messages, chat_tools

TOKENIZE_HOOK: list[Callable[..., Any]] = []
"""`art.tokenize.tokenize_history`, registered when that module loads (it imports this one)."""


# -- histories -------------------------------------------------------------------------------


class History:
    """ART's `art.trajectories.History`: the base of the API histories. (`art.History` stays our
    long-standing name of `LegacyHistory`.)"""

    protocol: ClassVar[str] = ""
    model: str | None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        raise ValueError(f"{type(self).__name__} cannot be represented as Chat Completions")

    def tokenize(
        self,
        *,
        base_model: str | None = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        """The history's token ids, logprobs and flags (`art.TokenizedHistory`)."""
        return TOKENIZE_HOOK[0](
            self,
            model=self.model,
            base_model=base_model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )


@dataclass
class ChatCompletionsHistory(History):
    protocol: ClassVar[str] = "chat_completions"
    model: str | None
    messages: list[dict[str, Any]]
    message_sources: list[ChatCompletionsMessageSource | None]
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return self


@dataclass
class AnthropicMessagesHistory(History):
    protocol: ClassVar[str] = "messages"
    model: str
    messages: list[dict[str, Any]]
    message_sources: list[AnthropicMessageSource | None]
    system: str | list[dict[str, Any]] | None = None
    system_source: MessagesExchange | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return anthropic_as_chat(self)


@dataclass
class ResponsesHistory(History):
    protocol: ClassVar[str] = "responses"
    model: str
    input: list[dict[str, Any]]
    input_sources: list[ResponsesItemSource | None]
    instructions: str | None = None
    instructions_source: ResponsesExchange | None = None
    tools: list[dict[str, Any]] | None = None
    conversation: Any = None
    previous_response_id: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        return responses_as_chat(self)


@dataclass
class CompletionsTokenHistory(History):
    protocol: ClassVar[str] = "completions_token"
    model: str
    prompt: list[int]
    prompt_sources: list[CompletionsTokenSourceSpan]
    sampled_spans: list[tuple[int, int]]

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        raise ValueError("Raw Completions history has no chat-message structure")


@dataclass
class CompletionsStringHistory(History):
    protocol: ClassVar[str] = "completions_string"
    model: str
    prompt: str
    prompt_sources: list[CompletionsStringSourceSpan]
    sampled_spans: list[tuple[int, int]]

    def as_chat_completions_history(self) -> ChatCompletionsHistory:
        raise ValueError("Raw Completions history has no chat-message structure")


ExchangeHistory = (
    ChatCompletionsHistory
    | AnthropicMessagesHistory
    | ResponsesHistory
    | CompletionsTokenHistory
    | CompletionsStringHistory
)


class TrajectoryLike(Protocol):
    """What the projections read of an `art.Trajectory` (this module sits below it)."""

    exchanges: TrajectoryExchanges
    messages_and_choices: list[Any]
    tools: Any
    additional_histories: list[Any]

    def legacy_histories(self) -> list[Any]: ...


# -- Chat Completions ------------------------------------------------------------------------


def normalize_chat_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message in its history form: no `annotations`, an assistant's None content as "",
    another role's None content left out, no empty `tool_calls`."""
    data = copy.deepcopy(dict(message))
    data.pop("annotations", None)
    if data.get("role") == "assistant" and data.get("content") is None:
        data["content"] = ""
    elif "content" in data and data["content"] is None:
        data.pop("content")
    if data.get("tool_calls") == []:
        data.pop("tool_calls")
    return data


def chat_key(message: Mapping[str, Any], *, visible_only: bool = False) -> str:
    data = normalize_chat_message(message)
    if visible_only:
        data.pop("reasoning", None)
        data.pop("reasoning_content", None)
    return json_key(data)


def ordered_choices(choices: Sequence[Any], protocol: str) -> list[Any]:
    """An exchange's choices in index order (each index once); ValueError naming `protocol` otherwise."""
    if not choices:
        raise ValueError(f"{protocol} response contains no choices")
    indices = [c.index for c in choices]
    if any(not is_int(i) or i < 0 for i in indices):
        raise ValueError(f"{protocol} choice indices must be non-negative integers")
    if len(set(indices)) != len(indices):
        raise ValueError(f"{protocol} response contains duplicate choice indices")
    return sorted(choices, key=lambda c: c.index)


def _contains(ids: Sequence[int], part: Sequence[int]) -> bool:
    return any(list(ids[i : i + len(part)]) == list(part) for i in range(len(ids) - len(part) + 1))


def _prompt_ids_of(exchange: Any) -> list[int] | None:
    """The exact prompt ids a call reported (its first choice's or generation's), else None."""
    try:
        if isinstance(exchange, ChatCompletionsExchange):
            choices = exchange.response.choices
            return chat_sampled(exchange, choices[0].index).prompt_ids if choices else None
        if isinstance(exchange, MessagesExchange):
            return messages_sampled(exchange).prompt_ids
        generations = responses_generations(exchange)
        return generations[0][0].prompt_ids if generations else None
    except ValueError:
        return None


def _continues(branch: Branch, exchange: Any) -> bool:
    """Whether the call's exact prompt ids carry on the branch's sampled ids: they extend the last
    sampled turn's ids (prompt + sampled), and contain the sampled ids of every earlier turn that
    had reasoning (ART's rule: a template that drops reasoning re-renders the turn). True when
    ids are unknown."""
    prompt = _prompt_ids_of(exchange)
    if not prompt:
        return True
    turns: list[tuple[Any, Sampled, Any]] = []
    for source, item in zip(branch.sources, branch.items):
        if not is_sampled(source):
            continue
        try:
            key, sampled = sampled_of(source)
        except ValueError:
            continue
        if sampled is not None and sampled.token_ids is not None and (not turns or turns[-1][0] != key):
            turns.append((key, sampled, item))
    for number, (_, sampled, item) in enumerate(turns):
        if number == len(turns) - 1 and sampled.prompt_ids is not None:
            so_far = [*sampled.prompt_ids, *(sampled.token_ids or [])]
            if prompt[: len(so_far)] != so_far:
                return False
        elif (
            isinstance(item, Mapping)
            and (item.get("reasoning") or item.get("reasoning_content"))
            and sampled.token_ids
            and not _contains(prompt, sampled.token_ids)
        ):
            return False
    return True


def _chat_context(request: Mapping[str, Any]) -> str:
    return json_key([request.get("tools"), request.get("chat_template"), request.get("chat_template_kwargs")])


def chat_completions_histories(trajectory: TrajectoryLike, *, model: str | None) -> list[ChatCompletionsHistory]:
    if not trajectory.exchanges:
        return [legacy_as_chat(history, model=model) for history in trajectory.legacy_histories()]
    out: list[ChatCompletionsHistory] = []
    for name, exchanges in select(trajectory.exchanges.chat_completions, model, "Chat Completions"):
        branches: list[Branch] = []
        for sequence, exchange in enumerate(exchanges):
            raw = exchange.request.get("messages") or []
            if not isinstance(raw, list) or not all(isinstance(m, Mapping) for m in raw):
                raise ValueError("Chat Completions request messages must be a list of JSON objects")
            prompt = [normalize_chat_message(m) for m in raw]
            lineage = [chat_key(m, visible_only=True) for m in prompt]
            defaults = [ChatCompletionsMessageSource(exchange, request_index=i) for i in range(len(prompt))]
            outputs = []
            for choice in ordered_choices(exchange.response.choices, "Chat Completions"):
                message = normalize_chat_message(choice.message.model_dump(mode="json", exclude_none=True))
                outputs.append(
                    (
                        choice.index,
                        [message],
                        [chat_key(message)],
                        [chat_key(message, visible_only=True)],
                        [ChatCompletionsMessageSource(exchange, choice_index=choice.index)],
                    )
                )
            call = Call(
                prompt,
                [chat_key(m) for m in prompt],
                lineage,
                lineage_sources(branches, lineage, defaults),
                outputs,
                _chat_context(exchange.request),
                sequence,
                exchange.start_time,
            )
            grow(branches, call, functools.partial(_continues, exchange=exchange))
        for branch in finished(branches):
            tools, template, kwargs = json.loads(branch.context)
            out.append(ChatCompletionsHistory(name, branch.items, branch.sources, tools, template, kwargs))
    return out


def chat_completions_history(trajectory: TrajectoryLike, *, model: str | None) -> ChatCompletionsHistory:
    return only(chat_completions_histories(trajectory, model=model), "Chat Completions history", model)


def legacy_as_chat(history: Any, *, model: str | None) -> ChatCompletionsHistory:
    """A `LegacyHistory` (messages and choices) as a chat history of user-written messages."""
    messages = [dict(m) for m in history.messages()]
    return ChatCompletionsHistory(model, messages, [None] * len(messages), copy.deepcopy(history.tools))


# -- Anthropic Messages ----------------------------------------------------------------------


def _anthropic_prompt(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ValueError("Anthropic messages must be a list")
    out = []
    for message in value:
        if not isinstance(message, Mapping):
            raise ValueError("Anthropic messages must be JSON objects")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise ValueError("Anthropic message content must be text or a list")
        if isinstance(content, list) and not all(isinstance(b, Mapping) or hasattr(b, "model_dump") for b in content):
            raise ValueError("Anthropic message content blocks must be JSON objects")
        out.append(copy.deepcopy(dict(message)))
    return out


def anthropic_key(message: Mapping[str, Any], *, visible_only: bool = False) -> str:
    """Text content as one text block, hidden thinking left out when `visible_only`, a server's
    token fields left out."""
    content = message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else []
    for block in content if isinstance(content, list) else []:
        data = as_dict(block, mode="json", exclude_none=True)
        if visible_only and data.get("type") in ("thinking", "redacted_thinking"):
            continue
        data.pop("token_ids", None)
        data.pop("logprobs", None)
        blocks.append(data)
    return json_key({**dict(message), "content": blocks})


def anthropic_response_message(exchange: MessagesExchange) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": [block.model_dump(mode="json", exclude_none=True) for block in exchange.response.content],
    }


def anthropic_messages_histories(trajectory: TrajectoryLike, *, model: str | None) -> list[AnthropicMessagesHistory]:
    out: list[AnthropicMessagesHistory] = []
    for name, exchanges in select(trajectory.exchanges.messages, model, "Anthropic Messages"):
        branches: list[Branch] = []
        for sequence, exchange in enumerate(exchanges):
            request = exchange.request
            prompt = _anthropic_prompt(request.get("messages", []))
            lineage = [anthropic_key(m, visible_only=True) for m in prompt]
            defaults = [AnthropicMessageSource(exchange, request_index=i) for i in range(len(prompt))]
            answer = anthropic_response_message(exchange)
            context = json_key(
                [
                    request.get("system"),
                    request.get("tools"),
                    request.get("chat_template"),
                    request.get("chat_template_kwargs"),
                ]
            )
            call = Call(
                prompt,
                [anthropic_key(m) for m in prompt],
                lineage,
                lineage_sources(branches, lineage, defaults),
                [
                    (
                        0,
                        [answer],
                        [anthropic_key(answer)],
                        [anthropic_key(answer, visible_only=True)],
                        [AnthropicMessageSource(exchange)],
                    )
                ],
                context,
                sequence,
                exchange.start_time,
                exchange if request.get("system") is not None else None,
            )
            grow(branches, call, functools.partial(_continues, exchange=exchange))
        for branch in finished(branches):
            system, tools, template, kwargs = json.loads(branch.context)
            out.append(
                AnthropicMessagesHistory(
                    name, branch.items, branch.sources, system, branch.context_source, tools, template, kwargs
                )
            )
    return out


def anthropic_messages_history(trajectory: TrajectoryLike, *, model: str | None) -> AnthropicMessagesHistory:
    return only(anthropic_messages_histories(trajectory, model=model), "Anthropic Messages history", model)


def anthropic_message_as_chat(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as the chat messages it stands for (tool results come out as
    `tool` messages first), thinking as `reasoning_content`."""
    converted = anthropic_chat_messages({"messages": [message]})
    content = message.get("content")
    thinking = (
        "".join(str(b.get("thinking") or "") for b in content if isinstance(b, Mapping) and b.get("type") == "thinking")
        if isinstance(content, list)
        else ""
    )
    if thinking and converted and converted[-1].get("role") == "assistant":
        converted[-1]["reasoning_content"] = thinking
    for item in converted:
        if item.get("role") == "assistant" and item.get("tool_calls") and not item.get("content"):
            item["content"] = None
    return [normalize_chat_message(m) for m in converted]


def anthropic_as_chat(history: AnthropicMessagesHistory) -> ChatCompletionsHistory:
    messages: list[dict[str, Any]] = []
    sources: list[ChatCompletionsMessageSource | None] = []
    if history.system:
        messages += anthropic_chat_messages({"system": history.system, "messages": []})
        sources.append(ChatCompletionsMessageSource(history.system_source) if history.system_source else None)
    for message, source in zip(history.messages, history.message_sources):
        converted = anthropic_message_as_chat(message)
        messages += converted
        if source is None:
            sources += [None] * len(converted)
        else:
            sampled = source.request_index is None
            sources += [
                ChatCompletionsMessageSource(
                    source.exchange, request_index=source.request_index, output_index=0 if sampled else None
                )
            ] * len(converted)
    return ChatCompletionsHistory(
        history.model,
        messages,
        sources,
        anthropic_chat_tools(history.tools),
        history.chat_template,
        copy.deepcopy(history.chat_template_kwargs),
    )


# -- Responses -------------------------------------------------------------------------------


def responses_histories(trajectory: TrajectoryLike, *, model: str | None) -> list[ResponsesHistory]:
    out: list[ResponsesHistory] = []
    for name, exchanges in select(trajectory.exchanges.responses, model, "Responses"):
        branches: list[Branch] = []
        threads = ResponsesThreads()
        for sequence, exchange in enumerate(exchanges):
            call = threads.call(exchange, sequence, branches)
            grow(branches, call, functools.partial(_continues, exchange=exchange))
        for branch in finished(branches):
            instructions, tools, conversation, outside, template, kwargs = json.loads(branch.context)
            out.append(
                ResponsesHistory(
                    name,
                    branch.items,
                    branch.sources,
                    instructions,
                    branch.context_source,
                    tools,
                    conversation,
                    outside,
                    template,
                    kwargs,
                )
            )
    return out


def responses_history(trajectory: TrajectoryLike, *, model: str | None) -> ResponsesHistory:
    return only(responses_histories(trajectory, model=model), "Responses history", model)


def _reasoning_text(item: Mapping[str, Any]) -> str:
    parts = [*(item.get("summary") or []), *(item.get("content") or [])]
    return "".join(str(p.get("text") or "") for p in parts if isinstance(p, Mapping))


def responses_items_as_chat(items: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
    """Responses input items as chat messages, each with the positions of the items it came from
    (a reasoning item joins the next assistant message as `reasoning`; function calls join the
    assistant message before them)."""
    out: list[tuple[dict[str, Any], list[int]]] = []
    pending: list[int] = []
    kept: list[Mapping[str, Any]] = []
    for position, item in enumerate(items):
        if item.get("type") == "reasoning":
            pending.append(position)
            continue
        before = len(_as_chat(kept))
        kept.append(item)
        after = _as_chat(kept)
        if len(after) == before:  # joined the previous message (a function call)
            out[-1][1].append(position)
            out[-1] = (after[-1], out[-1][1])
            continue
        message = after[-1]
        if pending and message.get("role") == "assistant":
            message["reasoning"] = "".join(_reasoning_text(items[i]) for i in pending)
            out.append((message, [*pending, position]))
        else:
            out += [
                ({"role": "assistant", "content": "", "reasoning": "".join(_reasoning_text(items[i]))}, [i])
                for i in pending
            ]
            out.append((message, [position]))
        pending = []
    out += [({"role": "assistant", "content": "", "reasoning": _reasoning_text(items[i])}, [i]) for i in pending]
    return [(normalize_chat_message(m), positions) for m, positions in out]


def _as_chat(items: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not items:
        return []
    try:
        return chat_messages({"input": list(items)})
    except ResponsesFormatError as exc:
        raise ValueError(f"Responses input cannot be represented as Chat Completions ({exc})") from None


def responses_as_chat(history: ResponsesHistory) -> ChatCompletionsHistory:
    if history.previous_response_id is not None or history.conversation is not None:
        raise ValueError("Opaque Responses context cannot be represented as Chat Completions")
    messages: list[dict[str, Any]] = []
    sources: list[ChatCompletionsMessageSource | None] = []
    if history.instructions:
        messages.append({"role": "system", "content": history.instructions})
        given = history.instructions_source
        sources.append(ChatCompletionsMessageSource(given) if given else None)
    for message, positions in responses_items_as_chat(history.input):
        messages.append(message)
        sources.append(_merged_source([history.input_sources[p] for p in positions]))
    return ChatCompletionsHistory(
        history.model,
        messages,
        sources,
        chat_tools(history.tools),
        history.chat_template,
        copy.deepcopy(history.chat_template_kwargs),
    )


def _merged_source(contributors: list[ResponsesItemSource | None]) -> ChatCompletionsMessageSource | None:
    if not contributors or any(s is None for s in contributors):
        return None
    present = [s for s in contributors if s is not None]
    if len({id(s.exchange) for s in present}) != 1:
        raise ValueError("One projected Chat message cannot span multiple Responses exchanges")
    generations = {s.generation_index for s in present if s.generation_index is not None}
    if len(generations) > 1:
        raise ValueError("One projected Chat message cannot span multiple Responses generations")
    return ChatCompletionsMessageSource(
        present[0].exchange,
        request_index=next((s.request_index for s in present if s.request_index is not None), None),
        output_index=next((s.output_index for s in present if s.output_index is not None), None),
        generation_index=next(iter(generations), None),
    )


__all__ = [
    "AnthropicMessageSource",
    "AnthropicMessagesHistory",
    "ChatCompletionsHistory",
    "ChatCompletionsMessageSource",
    "CompletionsSource",
    "CompletionsStringHistory",
    "CompletionsStringSourceSpan",
    "CompletionsTokenHistory",
    "CompletionsTokenSourceSpan",
    "ExchangeHistory",
    "History",
    "ResponsesHistory",
    "ResponsesItemSource",
]
