"""A trajectory's Completions exchanges as histories (`art.histories` explains histories): a
prompt of token ids (or text) with the spans each call sampled, one history per branch of calls
whose prompts extend each other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from art.numeric import is_int

from .exchange_tokens import completion_sampled, extra_fields
from .exchanges import CompletionsExchange
from .histories import CompletionsStringHistory, CompletionsTokenHistory, TrajectoryLike, ordered_choices
from .history_sources import (
    Branch,
    Call,
    CompletionsSource,
    CompletionsStringSourceSpan,
    CompletionsTokenSourceSpan,
    grow,
    only,
    select,
)


def completion_prompts(value: Any) -> list[str | list[int]]:
    """A Completions request's prompt as a list of prompts (text or token ids)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if all(is_int(t) for t in value):
            return [_prompt_ids(value)]
        prompts: list[str | list[int]] = []
        for item in value:
            if isinstance(item, str):
                prompts.append(item)
            elif isinstance(item, list) and all(is_int(t) for t in item):
                prompts.append(_prompt_ids(item))
            else:
                raise ValueError("Invalid batched Completions prompt")
        return prompts
    raise ValueError("Completions prompt must be text or token IDs")


def _prompt_ids(value: list[Any]) -> list[int]:
    if any(t < 0 for t in value):
        raise ValueError("Completions token prompts must contain non-negative integers")
    return list(value)


def completion_choice_groups(exchange: CompletionsExchange) -> list[list[Any]]:
    """The choices of each prompt of a (batched) Completions call: by a choice's `prompt_index`,
    else by its exact prompt ids, else `n` consecutive choices per prompt."""
    prompts = completion_prompts(exchange.request.get("prompt"))
    choices = ordered_choices(exchange.response.choices, "Completions")
    if len(prompts) == 1:
        return [choices]
    found: dict[int, int] = {}
    for choice in choices:
        given = extra_fields(choice).get("prompt_index")
        if given is not None:
            if not is_int(given) or not 0 <= given < len(prompts):
                raise ValueError("Completions choice prompt_index must identify a batched prompt")
            found[choice.index] = given
            continue
        ids = completion_sampled(exchange, choice.index).prompt_ids
        same = [i for i, p in enumerate(prompts) if isinstance(p, list) and p == ids]
        if len(same) == 1:
            found[choice.index] = same[0]
    requested = exchange.request.get("n")
    if len(found) == len(choices):
        groups: list[list[Any]] = [[] for _ in prompts]
        for choice in choices:
            groups[found[choice.index]].append(choice)
        if all(groups) and (requested is None or all(len(g) == requested for g in groups)):
            return groups
        raise ValueError("Cannot associate Completions choices with batched prompts")
    if len(choices) % len(prompts) or (requested is not None and requested != len(choices) // len(prompts)):
        raise ValueError("Cannot associate Completions choices with batched prompts")
    if [c.index for c in choices] != list(range(len(choices))):
        raise ValueError("Ambiguous Completions choice-to-prompt association")
    size = len(choices) // len(prompts)
    return [choices[i * size : (i + 1) * size] for i in range(len(prompts))]


def _spans(sources: Sequence[CompletionsSource | None]) -> list[tuple[int, int, CompletionsSource | None]]:
    runs: list[tuple[int, int, CompletionsSource | None]] = []
    for position, source in enumerate(sources):
        if runs and runs[-1][2] == source:
            runs[-1] = (runs[-1][0], position + 1, source)
        else:
            runs.append((position, position + 1, source))
    return runs


def _sampled_spans(branch: Branch) -> list[tuple[int, int]]:
    return [(start, end) for start, end, source in _spans(branch.sources) if source and source.choice_index is not None]


def _completions_branches(
    trajectory: TrajectoryLike, model: str | None, *, text: bool
) -> list[tuple[str, list[Branch]]]:
    out = []
    for name, exchanges in select(trajectory.exchanges.completions, model, "Completions"):
        branches: list[Branch] = []
        complete = True
        for sequence, exchange in enumerate(exchanges):
            if exchange.request.get("suffix") is not None:
                raise ValueError("Completions suffix is not supported")
            groups = completion_choice_groups(exchange)
            for prompt_index, request_prompt in enumerate(completion_prompts(exchange.request.get("prompt"))):
                for choice in groups[prompt_index]:
                    if text:
                        if not isinstance(request_prompt, str):
                            complete = False
                            continue
                        prompt: list[Any] = list(request_prompt)
                        answer = choice.text
                        if exchange.request.get("echo") is True:
                            if not answer.startswith(request_prompt):
                                raise ValueError("Cannot locate echoed Completions prompt boundary")
                            answer = answer[len(request_prompt) :]
                        output: list[Any] = list(answer)
                    else:
                        sampled = completion_sampled(exchange, choice.index)
                        ids = (
                            sampled.prompt_ids
                            if sampled.prompt_ids is not None
                            else (request_prompt if isinstance(request_prompt, list) else None)
                        )
                        if ids is None or sampled.token_ids is None:
                            complete = False
                            continue
                        prompt, output = list(ids), list(sampled.token_ids)
                    keys = [str(t) for t in prompt]
                    out_keys = [str(t) for t in output]
                    source = CompletionsSource(exchange, prompt_index)
                    chosen = CompletionsSource(exchange, prompt_index, choice.index)
                    grow(
                        branches,
                        Call(
                            prompt,
                            keys,
                            keys,
                            [source] * len(prompt),
                            [(choice.index, output, out_keys, out_keys, [chosen] * len(output))],
                            "",
                            sequence,
                            exchange.start_time,
                        ),
                    )
        if not complete:
            raise ValueError(
                "Completions string history requires text prompts for every choice"
                if text
                else "Completions token history requires exact token IDs for every choice"
            )
        out.append((name, branches))
    return out


def completions_token_histories(trajectory: TrajectoryLike, *, model: str | None) -> list[CompletionsTokenHistory]:
    histories = [
        CompletionsTokenHistory(
            name,
            list(b.items),
            [CompletionsTokenSourceSpan(s, e, src) for s, e, src in _spans(b.sources)],
            _sampled_spans(b),
        )
        for name, branches in _completions_branches(trajectory, model, text=False)
        for b in branches
    ]
    if not histories:
        raise ValueError("Completions token history requires exact token IDs")
    return histories


def completions_token_history(trajectory: TrajectoryLike, *, model: str | None) -> CompletionsTokenHistory:
    return only(completions_token_histories(trajectory, model=model), "Completions token history", None)


def completions_string_histories(trajectory: TrajectoryLike, *, model: str | None) -> list[CompletionsStringHistory]:
    histories = [
        CompletionsStringHistory(
            name,
            "".join(b.items),
            [CompletionsStringSourceSpan(s, e, src) for s, e, src in _spans(b.sources)],
            _sampled_spans(b),
        )
        for name, branches in _completions_branches(trajectory, model, text=True)
        for b in branches
    ]
    if not histories:
        raise ValueError("Completions string history requires text prompts")
    return histories


def completions_string_history(trajectory: TrajectoryLike, *, model: str | None) -> CompletionsStringHistory:
    return only(completions_string_histories(trajectory, model=model), "Completions string history", None)
