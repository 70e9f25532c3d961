"""`wrap_rollout`: run a LangGraph rollout under `art.capture` and train what its model really said.

The rollout builds its trajectory as ART's docs show (`messages_and_choices=[]`, a reward, metrics);
the wrapper fills the conversation from the capture: each call to the trained model a `Choice` with
the sampler's token ids and logprobs (so it trains exactly as sampled), the messages around it (tool
results, prompts) context dicts, one history per conversation. Calls to other models made during
the rollout (an LLM judge, a user simulator) are not the policy's tokens: they are left out, or
kept as context where they sit inside the policy's own conversation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

from openai.types.chat.chat_completion import Choice

from art.capture import AutoTrajectoryContext
from art.exchanges import Exchange, TrajectoryExchanges
from art.model import Model
from art.trajectories import History, Trajectory, get_messages, is_choice

from .context import served_names, training

T = TypeVar("T", bound=Trajectory)


@overload
def wrap_rollout(
    model: Model, fn: None = None
) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]: ...
@overload
def wrap_rollout(model: Model, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]: ...
def wrap_rollout(model: Model, fn: Callable[..., Any] | None = None) -> Any:
    """`wrap_rollout(model, fn)` (ART's form) or `@wrap_rollout(model)`: `fn` run so that every
    `init_chat_model()` inside talks to `model` and every chat completion is captured.

    `fn` returns its `Trajectory` (its class, reward, metrics, metadata are kept), or None to return
    the captured one (reward set through `art.current_trajectory()`). Once the model was called, the
    returned trajectory's `messages_and_choices` and `tools` are the first conversation with it, and
    its other conversations are appended to `additional_histories`; `exchanges` and `logs` say what
    was captured. With no call, the trajectory is returned as built. An exception `fn` raises
    propagates, as in ART.
    """
    if not isinstance(model, Model):
        raise TypeError(
            f"wrap_rollout() takes the ART model first, as in wrap_rollout(model, fn); got {type(model).__name__}"
        )
    if fn is None:
        return lambda fn: wrap_rollout(model, fn)

    @functools.wraps(fn)
    async def rollout(*args: Any, **kwargs: Any) -> Trajectory:
        with training(model), AutoTrajectoryContext() as captured:
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
        if result is None:
            result = captured
        elif not isinstance(result, Trajectory):
            raise TypeError(
                f"the rollout {getattr(fn, '__qualname__', fn)!r} returned {type(result).__name__}; "
                "wrap_rollout expects an art.Trajectory (or None for the captured one)"
            )
        return _fill(result, captured, served_names(model))

    return rollout


def _fill(result: T, captured: Trajectory, names: set[str]) -> T:
    """`result` with the captured conversations of the trained model (named `names`)."""
    exchanges = captured.exchanges.chat_completions
    ours = [e for e in exchanges if _is_ours(e.model, names)]
    firsts = [_choice0(e.response.choices) for e in exchanges if not _is_ours(e.model, names)]
    foreign = [c for c in firsts if c is not None]
    sources: list[Trajectory | History] = [captured, *captured.additional_histories]
    histories = [_as_context(h.messages_and_choices, foreign) for h in sources]
    tools = [h.tools for h in sources]
    kept = [(items, t) for items, t in zip(histories, tools) if any(is_choice(i) for i in items)]
    logs = list(captured.logs)
    if foreign:
        models = sorted({e.model or "?" for e in exchanges if not _is_ours(e.model, names)})
        logs.append(
            f"wrap_rollout: {len(foreign)} chat completion(s) to other models ({', '.join(models)}) "
            "are not trained: left out, or context inside the trained model's conversation"
        )
    others = [] if result is captured else list(result.additional_histories)
    if kept:
        (items, first_tools), rest = kept[0], kept[1:]
        if result is not captured and result.messages_and_choices:
            logs.append(
                f"wrap_rollout: the {len(result.messages_and_choices)} messages the rollout returned were "
                "replaced by the captured conversation"
            )
        result.messages_and_choices = items
        result.tools = first_tools
        result.additional_histories = [*others, *(History(messages_and_choices=i, tools=t) for i, t in rest)]
    elif result is captured:  # only other models were called
        result.messages_and_choices, result.tools, result.additional_histories = [], None, []
    calls = captured.exchanges  # the other APIs' calls stay as they were
    kept_calls: list[Exchange] = [*ours, *calls.completions, *calls.responses, *calls.messages]
    if result is captured:
        result.logs = logs
        result.exchanges = TrajectoryExchanges()
    else:
        result.logs = [*result.logs, *logs]
    for call in kept_calls:
        result.exchanges.add(call)
    return result


def _is_ours(requested: str | None, names: set[str]) -> bool:
    return requested is not None and (requested in names or requested.rsplit("@", 1)[0] in names)


def _choice0(choices: list[Choice]) -> Choice | None:
    return next((c for c in choices if c.index == 0), None)


def _as_context(items: list[Any], foreign: list[Choice]) -> list[Any]:
    """`items` with each choice another model made turned into the message it carries."""
    if not foreign:
        return list(items)
    return [
        get_messages([item])[0] if is_choice(item) and any(_same(item, f) for f in foreign) else item for item in items
    ]


def _same(recorded: Choice, answered: Choice) -> bool:
    """Whether a recorded choice is the one an exchange received (a stream that never named its
    finish reason is "stop" in the exchange, what the model did in the recorded choice)."""
    return recorded.model_dump(exclude={"finish_reason"}) == answered.model_dump(exclude={"finish_reason"})
