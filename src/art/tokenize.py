"""Histories -> token ids, logprobs and flags: what a trajectory trains on, as ART's `tokenize` shows it.

Exact first. Where the server reported what it sampled (vLLM's and ours: `prompt_token_ids`,
`token_ids`, per-token logprobs), a history's tokens are those ids, nothing re-tokenised: the
first sampled turn's prompt ids, its sampled ids, then each next turn's prompt ids beyond the ids
so far and its sampled ids. Flags: EXACT on every such token, SAMPLED on the sampled ones; logprobs
are the sampler's on sampled tokens and NaN elsewhere. This is exactly what our trainer builds
(`art.training.sequences.sequences_of_history`: token ids, `trained`, `sampler_logprobs`), which a
test checks; a history whose next prompt does not extend the ids so far is split into two
histories (`art.histories`) where the trainer starts a new sequence.

Rendered otherwise. Without exact ids (another server, a user-written history), the chat
template renders the messages (`tokenizer=`, else `AutoTokenizer.from_pretrained(base_model or
model)`), as our routes render a prompt (`art.chat_template`), and a sampled assistant message's
tokens are those from where the template's generation prompt ends to its last stop token (the
rule `art.training.chat_tokens` uses for SFT): SAMPLED without EXACT, logprobs NaN.

Nothing here trains, or imports torch or transformers at import time.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from enum import IntFlag
from functools import lru_cache
from typing import Any, Generic, Protocol, TypeVar

import pydantic

from . import completions_histories, histories as h
from .chat_template import ChatMessage, template_messages
from .exchange_tokens import Sampled, chat_logprobs, completion_sampled, is_sampled, sampled_of, token_ids
from .exchange_turns import anthropic_chat_messages
from .exchanges import ChatCompletionsExchange, MessagesExchange

MetadataValue = Any


class Tokenizer(Protocol):
    """What tokenizing uses of a tokenizer (a Hugging Face tokenizer has it)."""

    def __call__(self, text: str, *, add_special_tokens: bool = False) -> object: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: object,
        tokenize: bool,
        add_generation_prompt: bool,
        chat_template: str | None = None,
        **kwargs: object,
    ) -> object: ...


class TokenFlag(IntFlag):
    """Facts about one token; they combine."""

    EXACT = 1 << 0
    """The id is the one the server reported, not one tokenizing text gave."""
    SAMPLED = 1 << 1
    """The model sampled it (it trains); else it is prompt."""


class TokenizedHistory(pydantic.BaseModel):
    """One history's tokens; the three lists are aligned, one entry per token."""

    model: str
    token_ids: list[int]  # [tokens]
    logprobs: list[float]  # [tokens] the sampler's logprob of a sampled token; NaN where unknown
    flags: list[TokenFlag]  # [tokens]

    @pydantic.model_validator(mode="after")
    def _aligned(self) -> TokenizedHistory:
        if not len(self.token_ids) == len(self.logprobs) == len(self.flags):
            raise ValueError("Tokenized history fields differ in length")
        return self


class TokenizedTrajectory(TokenizedHistory):
    """A one-history trajectory's tokens with its reward, metrics and metadata."""

    reward: float
    metrics: dict[str, float | int | bool]
    metadata: dict[str, MetadataValue]


class TokenizedMultiHistoryTrajectory(pydantic.BaseModel):
    """A trajectory's histories' tokens (`tokenize(multi_history=True)`)."""

    histories: list[TokenizedHistory]
    reward: float
    metrics: dict[str, float | int | bool]
    metadata: dict[str, MetadataValue]


TokenizedTrajectoryT = TypeVar("TokenizedTrajectoryT", TokenizedTrajectory, TokenizedMultiHistoryTrajectory)


class TokenizedTrajectoryGroup(pydantic.BaseModel, Generic[TokenizedTrajectoryT]):
    trajectories: list[TokenizedTrajectoryT]
    metrics: dict[str, float | int | bool]
    metadata: dict[str, MetadataValue]


class _Tokens:
    """Token ids, logprobs and flags being built."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.flags: list[TokenFlag] = []

    def add(self, ids: Sequence[int], flag: TokenFlag, logprobs: Sequence[float] | None = None) -> None:
        self.ids += ids
        self.flags += [flag] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None and len(logprobs) == len(ids) else [math.nan] * len(ids)

    def done(self, model: str) -> TokenizedHistory:
        return TokenizedHistory(model=model, token_ids=self.ids, logprobs=self.logprobs, flags=self.flags)


# -- entry points ------------------------------------------------------------------------------


def tokenize_history(
    history: Any,
    *,
    model: str | None,
    base_model: str | None = None,
    tokenizer: Any = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> TokenizedHistory:
    """One history's tokens (see the module docstring). A legacy history needs `model=`."""
    render = _Renderer(tokenizer, base_model, model, chat_template, chat_template_kwargs)
    protocol = getattr(history, "protocol", None)
    if protocol is None:  # a LegacyHistory: message dicts and Choices
        if model is None:
            raise ValueError("Legacy history tokenization requires model=")
        return _legacy(history, model, render)
    if model is None:
        raise ValueError("History tokenization requires a model")
    if protocol == "completions_token":
        return _completions_tokens(history)
    if protocol == "completions_string":
        return _completions_text(history, render)
    if protocol == "responses" and (history.previous_response_id is not None or history.conversation is not None):
        _check_responses_sources(history)
        exact = _exact(history.input, history.input_sources)
        if exact is None:
            raise ValueError(
                "A Responses history with opaque context (previous_response_id or conversation "
                "outside the trajectory) needs exact token ids: it cannot be rendered"
            )
        return exact.done(model)
    if protocol == "responses":
        _check_responses_sources(history)
    chat = history.as_chat_completions_history()
    check_chat_sources(chat)
    overridden = (chat_template is not None and chat_template != chat.chat_template) or (
        chat_template_kwargs is not None and dict(chat_template_kwargs) != (chat.chat_template_kwargs or {})
    )
    if not overridden:
        exact = _exact(chat.messages, chat.message_sources)
        if exact is not None:
            return exact.done(model)
    sampled = [m.get("role") == "assistant" and is_sampled(s) for m, s in zip(chat.messages, chat.message_sources)]
    evidence = [sampled_of(s)[1] if flag else None for flag, s in zip(sampled, chat.message_sources)]
    return render.chat(
        chat.messages, chat.tools, sampled, evidence, chat.chat_template, chat.chat_template_kwargs
    ).done(model)


def tokenize_trajectory(
    trajectory: Any,
    *,
    multi_history: bool = False,
    model: str | None = None,
    base_model: str | None = None,
    tokenizer: Any = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> Any:
    """`Trajectory.tokenize`: its one history's tokens, or every history's (`multi_history=True`)."""
    found = trajectory.histories(model=model)
    if not multi_history and len(found) != 1:
        if model is None and len({x.model for x in found if getattr(x, "protocol", None)}) > 1:
            raise ValueError("Trajectory tokenization requires exactly one model; pass model= to select one")
        raise ValueError(f"Trajectory tokenization requires exactly one history; found {len(found)}")
    tokenized = [
        tokenize_history(
            history,
            model=history.model if getattr(history, "protocol", None) else model,
            base_model=base_model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        for history in found
    ]
    scores = {"reward": trajectory.reward, "metrics": dict(trajectory.metrics), "metadata": dict(trajectory.metadata)}
    if multi_history:
        return TokenizedMultiHistoryTrajectory(histories=tokenized, **scores)
    return TokenizedTrajectory(**tokenized[0].model_dump(), **scores)


def tokenize_group(group: Any, *, multi_history: bool = False, **options: Any) -> TokenizedTrajectoryGroup:
    """`TrajectoryGroup.tokenize`: each trajectory's tokens (options as `tokenize_trajectory`)."""
    kind = TokenizedMultiHistoryTrajectory if multi_history else TokenizedTrajectory
    return TokenizedTrajectoryGroup[kind](  # type: ignore[valid-type]
        trajectories=[tokenize_trajectory(t, multi_history=multi_history, **options) for t in group.trajectories],
        metrics=dict(group.metrics),
        metadata=dict(group.metadata),
    )


h.TOKENIZE_HOOK[:] = [tokenize_history]


# -- exact ids ---------------------------------------------------------------------------------


def _exact(items: Sequence[Any], sources: Sequence[Any]) -> _Tokens | None:
    """The exact tokens of a history whose every sampled item carries the server's ids and whose
    last item was sampled; None when some are missing (then it is rendered). ValueError when a
    turn's prompt ids do not extend the ids before it."""
    units: list[tuple[Any, Sampled]] = []
    seen = set()
    for source in sources:
        if not is_sampled(source):
            continue
        key, sampled = sampled_of(source)
        if key in seen:
            continue
        if sampled is None or not sampled.prompt_ids or sampled.token_ids is None:
            return None
        seen.add(key)
        units.append((key, sampled))
    if not units or not sources or not is_sampled(sources[-1]) or sampled_of(sources[-1])[0] != units[-1][0]:
        return None
    return _chain([sampled for _, sampled in units])


def _chain_start(turns: Sequence[Sampled]) -> int:
    start = 0
    for number in range(1, len(turns)):
        before = [*(turns[number - 1].prompt_ids or []), *(turns[number - 1].token_ids or [])]
        if (turns[number].prompt_ids or [])[: len(before)] != before:
            start = number
    return start


def _chain(turns: Sequence[Sampled]) -> _Tokens:
    """Sampled turns as one token sequence: from the last turn whose prompt ids do not extend the
    turn before it (earlier turns are then in its prompt, context, as the trainer reads them; their
    own history trains them), each prompt's new ids then each turn's sampled ids."""
    tokens = _Tokens()
    for sampled in turns[_chain_start(turns) :]:
        tokens.add((sampled.prompt_ids or [])[len(tokens.ids) :], TokenFlag.EXACT)
        tokens.add(sampled.token_ids or [], TokenFlag.EXACT | TokenFlag.SAMPLED, sampled.logprobs)
    return tokens


def _legacy(history: Any, model: str, render: _Renderer) -> TokenizedHistory:
    """A LegacyHistory: exact from its Choices' ids (as the trainer reads them), else rendered."""
    items = list(history.messages_and_choices)
    choices = [item for item in items if not isinstance(item, Mapping) and hasattr(item, "message")]
    if choices and all(_choice_ids(c) is not None for c in choices) and not isinstance(items[-1], Mapping):
        turns: list[Sampled] = [_choice_ids(c) for c in choices]  # type: ignore[misc]
        if _chain_start(turns):
            raise ValueError(
                "a later choice's prompt ids do not extend the earlier ones: this history trains as "
                "several token sequences, which one TokenizedHistory cannot show"
            )
        return _chain(turns).done(model)
    messages = [dict(m) for m in history.messages()]
    sampled = [not isinstance(item, Mapping) for item in items]
    evidence = [_choice_ids(item) if flag else None for item, flag in zip(items, sampled)]
    return render.chat(messages, history.tools, sampled, evidence, None, None).done(model)


def _choice_ids(choice: Any) -> Sampled | None:
    extra = getattr(choice, "model_extra", None) or {}
    prompt = extra.get("prompt_token_ids", getattr(choice, "prompt_token_ids", None))
    ids = extra.get("token_ids", getattr(choice, "token_ids", None))
    if not prompt or ids is None:
        return None
    return Sampled(
        token_ids(prompt, "prompt_token_ids"),
        token_ids(ids, "token_ids"),
        chat_logprobs(getattr(choice, "logprobs", None)),
    )


def _check_responses_sources(history: Any) -> None:
    if len(history.input) != len(history.input_sources):
        raise ValueError("ResponsesHistory input and input_sources differ in length")
    for index, (item, source) in enumerate(zip(history.input, history.input_sources)):
        if source is None:
            continue
        if source.exchange.model != history.model:
            raise ValueError("History model no longer matches its source exchange")
        if source.request_index is not None:
            expected = _at(h.responses_input(source.exchange.request.get("input")), source.request_index)
        else:
            expected = _at(h.responses_output_items(source.exchange), source.output_index)
        if h.json_key(item) != h.json_key(expected):
            raise ValueError(f"History input item {index} no longer matches its source exchange")


# -- sources checked against their exchanges ---------------------------------------------------


def chat_source_messages(source: h.ChatCompletionsMessageSource) -> list[dict[str, Any]]:
    """The chat messages `source` stands for, as its exchange has them now (one message, or
    several for an Anthropic message that expands to tool results and text)."""
    exchange = source.exchange
    if isinstance(exchange, ChatCompletionsExchange):
        if source.choice_index is not None:
            choice = next((c for c in exchange.response.choices if c.index == source.choice_index), None)
            if choice is None:
                raise ValueError("Chat Completions source choice is out of bounds")
            return [h.normalize_chat_message(choice.message.model_dump(mode="json", exclude_none=True))]
        return [h.normalize_chat_message(_at(exchange.request.get("messages") or [], source.request_index))]
    if isinstance(exchange, MessagesExchange):
        if source.request_index is not None:
            return h.anthropic_message_as_chat(_at(exchange.request.get("messages") or [], source.request_index))
        if source.output_index is not None:
            return h.anthropic_message_as_chat(h.anthropic_response_message(exchange))
        return [
            h.normalize_chat_message(m)
            for m in anthropic_chat_messages({"system": exchange.request.get("system"), "messages": []})
        ]
    # A Responses item joins others in one chat message (reasoning, function calls): any message
    # that the request's (or response's) items make, with this one among its items, is it.
    if source.request_index is not None:
        items = h.responses_input(exchange.request.get("input"))
        _at(items, source.request_index)
        return [m for m, positions in h.responses_items_as_chat(items) if source.request_index in positions]
    if source.output_index is not None:
        items = h.responses_output_items(exchange)
        _at(items, source.output_index)
        return [m for m, positions in h.responses_items_as_chat(items) if source.output_index in positions]
    instructions = exchange.request.get("instructions")
    return [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []


def _at(items: Sequence[Any], index: int | None) -> Any:
    if index is None or isinstance(index, bool) or not 0 <= index < len(items):
        raise ValueError(f"history source index {index!r} is out of bounds")
    return items[index]


def check_chat_sources(history: h.ChatCompletionsHistory) -> None:
    """Raise ValueError when the history's sources no longer fit it: lengths, model, or a message
    edited away from what its exchange holds (reasoning aside: templates may drop it)."""
    if len(history.messages) != len(history.message_sources):
        raise ValueError("h.ChatCompletionsHistory messages and message_sources differ in length")
    for index, (message, source) in enumerate(zip(history.messages, history.message_sources)):
        if source is None:
            continue
        if history.model is not None and source.exchange.model != history.model:
            raise ValueError("History model no longer matches its source exchange")
        expected = {h.chat_key(m, visible_only=True) for m in chat_source_messages(source)}
        if h.chat_key(message, visible_only=True) not in expected:
            raise ValueError(f"History message {index} no longer matches its source exchange")


# -- Completions -------------------------------------------------------------------------------


def _check_spans(history: Any) -> None:
    cursor = 0
    for span in history.prompt_sources:
        if span.start != cursor or span.end <= span.start or span.end > len(history.prompt):
            raise ValueError("Completions source spans must exhaustively cover prompt, in order and in bounds")
        cursor = span.end
    if cursor != len(history.prompt):
        raise ValueError("Completions source spans must exhaustively cover prompt")
    choice_backed = []
    for span in history.prompt_sources:
        if span.source is None:
            continue
        if span.source.exchange.model != history.model:
            raise ValueError("Completions history model no longer matches its source exchange")
        if span.source.choice_index is not None:
            choice_backed.append((span.start, span.end))
    if [tuple(s) for s in history.sampled_spans] != choice_backed:
        raise ValueError("Completions sampled spans must exactly match choice-backed source spans")


def _completion_evidence(source: h.CompletionsSource) -> Sampled:
    groups = completions_histories.completion_choice_groups(source.exchange)
    if not 0 <= source.prompt_index < len(groups):
        raise ValueError("Completions prompt source index is out of bounds")
    group = groups[source.prompt_index]
    index = group[0].index if source.choice_index is None else source.choice_index
    if all(c.index != index for c in group):
        raise ValueError("Completions choice source does not belong to its prompt")
    return completion_sampled(source.exchange, index)


def _completions_tokens(history: Any) -> TokenizedHistory:
    _check_spans(history)
    tokens = _Tokens()
    for span in history.prompt_sources:
        ids = list(history.prompt[span.start : span.end])
        if span.source is None:
            tokens.add(ids, TokenFlag(0))
            continue
        sampled = _completion_evidence(span.source)
        if span.source.choice_index is not None:
            if sampled.token_ids != ids:
                raise ValueError("Completions sampled output no longer matches its source exchange")
            tokens.add(ids, TokenFlag.EXACT | TokenFlag.SAMPLED, sampled.logprobs)
        elif (
            _prompt_part(sampled.prompt_ids if sampled.prompt_ids is not None else _request_prompt(span.source), span)
            == ids
        ):
            # a prompt starts the history: this span is its part [start, end) (the rest continues an earlier call)
            tokens.add(ids, TokenFlag.EXACT, _prompt_part(sampled.prompt_logprobs, span))
        else:
            tokens.add(ids, TokenFlag(0))  # edited: the ids are the user's now
    return tokens.done(history.model)


def _prompt_part(values: Any, span: Any) -> Any:
    return list(values[span.start : span.end]) if isinstance(values, list) and len(values) >= span.end else None


def _request_prompt(source: h.CompletionsSource) -> Any:
    return completions_histories.completion_prompts(source.exchange.request.get("prompt"))[source.prompt_index]


def _completions_text(history: Any, render: _Renderer) -> TokenizedHistory:
    _check_spans(history)
    tokens = _Tokens()
    for span in history.prompt_sources:
        text = history.prompt[span.start : span.end]
        source = span.source
        if source is None:
            tokens.add(render.text(text), TokenFlag(0))
            continue
        sampled = _completion_evidence(source)
        if source.choice_index is None:
            whole = span.start == 0 and text == _request_prompt(source)
            exact = sampled.prompt_ids if whole else None
            if exact is not None:
                tokens.add(exact, TokenFlag.EXACT, sampled.prompt_logprobs)
            else:
                tokens.add(render.text(text), TokenFlag(0))
            continue
        choice = next(c for c in source.exchange.response.choices if c.index == source.choice_index)
        expected = choice.text
        if source.exchange.request.get("echo") is True:
            expected = expected[len(_request_prompt(source)) :]
        if text != expected:
            raise ValueError("Completions history text no longer matches its source exchange")
        if sampled.token_ids is not None:
            tokens.add(sampled.token_ids, TokenFlag.EXACT | TokenFlag.SAMPLED, sampled.logprobs)
        else:
            tokens.add(render.text(text), TokenFlag.SAMPLED, _visible_logprobs(choice))
    return tokens.done(history.model)


def _visible_logprobs(choice: Any) -> list[float] | None:
    values = list(getattr(getattr(choice, "logprobs", None), "token_logprobs", None) or [])
    return [float(v) for v in values] if values and all(isinstance(v, (int, float)) for v in values) else None


# -- rendering with a chat template ------------------------------------------------------------


@lru_cache(maxsize=4)
def _load_tokenizer(name: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # the client install has no transformers
        raise ImportError(
            "tokenizing a history without exact token ids needs a tokenizer: pass tokenizer=, "
            "or pip install transformers to load base_model="
        ) from exc
    return AutoTokenizer.from_pretrained(name)


def _ids(encoded: Any) -> list[int]:
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(i) for i in encoded]


class _Renderer:
    """A tokenizer, loaded on first use, and the template options to render with."""

    def __init__(
        self,
        tokenizer: Any,
        base_model: str | None,
        model: str | None,
        chat_template: str | None,
        chat_template_kwargs: Mapping[str, object] | None,
    ) -> None:
        self._tokenizer, self.name = tokenizer, base_model or model
        self.template, self.kwargs = chat_template, dict(chat_template_kwargs or {})

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if not self.name:
                raise ValueError("tokenizing without exact token ids needs tokenizer= or base_model=")
            self._tokenizer = _load_tokenizer(self.name)
        return self._tokenizer

    def text(self, text: str) -> list[int]:
        return _ids(self.tokenizer(text, add_special_tokens=False))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        generation: bool,
        template: str | None,
        kwargs: Mapping[str, Any],
    ) -> list[int]:
        tokenizer = self.tokenizer
        if isinstance(getattr(tokenizer, "chat_template", None), str):
            # A real template: the messages and tools as our routes hand them to it (`art.chat_template`).
            try:
                messages, tools = template_messages(
                    tokenizer, [ChatMessage.model_validate(m).for_template() for m in messages], tools, None
                )
            except (pydantic.ValidationError, ValueError):
                pass  # content our routes refuse (images): hand it over as it is
        options = {**({"chat_template": template} if template else {}), **kwargs}
        return _ids(
            tokenizer.apply_chat_template(
                copy.deepcopy(messages), tools=tools, tokenize=True, add_generation_prompt=generation, **options
            )
        )

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        sampled: list[bool],
        evidence: list[Any],
        template: str | None,
        kwargs: Mapping[str, Any] | None,
    ) -> _Tokens:
        """R(messages): sampled assistant message k is the tokens from len(R(messages[:k],
        generation prompt)) to the last stop token of R(messages[:k+1]); each rendering must begin
        the next. Where the server's ids for the turn equal what the template renders, they are EXACT."""
        template = self.template or template
        options = {**(kwargs or {}), **self.kwargs}
        last_assistant = bool(messages) and messages[-1].get("role") == "assistant"
        full = self.render(messages, tools, not last_assistant, template, options)
        stops = {getattr(self.tokenizer, "eos_token_id", None)} - {None}
        marks: list[tuple[int, int, Any]] = []
        for k, message in enumerate(messages):
            if not sampled[k] or message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:k], tools, True, template, options) if k else []
            turn = self.render(messages[: k + 1], tools, False, template, options)
            if turn[: len(prompt)] != prompt or full[: len(turn)] != turn:
                raise ValueError(
                    f"Could not locate sampled history message {k} in the rendered history: the chat "
                    "template renders earlier messages differently once later ones are added"
                )
            end = max((i + 1 for i in range(len(prompt), len(turn)) if turn[i] in stops), default=len(turn))
            marks.append((len(prompt), end, evidence[k]))
        tokens, cursor = _Tokens(), 0
        for start, end, sampled_turn in marks:
            if start < cursor:
                raise ValueError("Rendered assistant spans overlap")
            tokens.add(full[cursor:start], TokenFlag(0))
            span = full[start:end]
            exact = sampled_turn is not None and sampled_turn.token_ids == span
            if exact:
                tokens.add(span, TokenFlag.EXACT | TokenFlag.SAMPLED, sampled_turn.logprobs)
            else:
                tokens.add(span, TokenFlag.SAMPLED)
            cursor = end
        tokens.add(full[cursor:], TokenFlag(0))
        return tokens


__all__ = [
    "TokenFlag",
    "TokenizedHistory",
    "TokenizedMultiHistoryTrajectory",
    "TokenizedTrajectory",
    "TokenizedTrajectoryGroup",
    "Tokenizer",
    "tokenize_group",
    "tokenize_history",
    "tokenize_trajectory",
]
