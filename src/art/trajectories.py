"""What a rollout produces: a `Trajectory` (messages, model choices, reward) and a `TrajectoryGroup`.

Choices stay the OpenAI `Choice` objects the model returned, because their token ids and
logprobs are what training needs; pydantic must neither turn them into dicts nor turn plain
message dicts into choices, so both fields below use hand-written validators and serialisers.
A group built from coroutines is awaitable: it runs them concurrently (`art.rollout_runs`)
and keeps rollout exceptions aside instead of failing the group. `with art.Trajectory()` and
`with art.TrajectoryGroup()` open the scopes of `art.trajectory_scopes`. This module knows
nothing of models, backends or torch; `art.gather` adds the progress bar and the exception limit.
"""

from __future__ import annotations

import copy
import inspect
import math
import traceback
from collections.abc import Awaitable, Generator, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, cast

from openai.types.chat.chat_completion import Choice
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import to_jsonable_python

from art.numeric import is_int

from . import completions_histories as _completions, histories as _histories, trajectory_histories as _all_histories
from .errors import TrajectoryError
from .exchange_turns import ChatTurn, NotATurn, chat_turn
from .exchanges import (  # the exchange types, importable from here as from ART's art.trajectories
    ChatCompletionsExchange as ChatCompletionsExchange,
    ChatCompletionsRequest as ChatCompletionsRequest,
    CompletionsExchange as CompletionsExchange,
    CompletionsRequest as CompletionsRequest,
    MessagesExchange as MessagesExchange,
    MessagesRequest as MessagesRequest,
    ResponsesExchange as ResponsesExchange,
    ResponsesRequest as ResponsesRequest,
    TrajectoryExchanges,
)
from .message_items import (
    MessagesAndChoicesField,
    ToolsField,
    get_messages,
    is_choice,
    message_key,
    tools_key,
)
from .observability import tracing
from .rollout_runs import (
    ROLLOUT_REPORTER,
    run_rollouts,
)
from .tokenize import TokenizedTrajectoryGroup, tokenize_group, tokenize_history, tokenize_trajectory
from .trajectory_scopes import (
    current_group_scope,
    enter_group_scope,
    enter_scope,
    exit_group_scope,
    exit_scope,
)
from .types import Messages, Tools

MetricValue = float | int | bool
MetadataValue = Any
"""Any JSON value (nested dicts and lists too), as in ART; checked when the trajectory is dumped."""


def add_turn(trajectory: Trajectory, turn: ChatTurn) -> None:
    """Append the turn's new messages and choice to the longest history (the trajectory or one of
    its `additional_histories`) whose messages and tools begin the turn's request (the trajectory
    first when empty), or to a new additional history when none does."""
    histories: list[Trajectory | History] = [trajectory, *trajectory.additional_histories]
    request = [message_key(m) for m in turn.messages]
    target, best = None, -1
    for history in histories:
        items = history.messages_and_choices
        if not items or len(items) > len(turn.messages) or tools_key(history.tools) != tools_key(turn.tools):
            continue
        if [message_key(m) for m in get_messages(items)] == request[: len(items)] and len(items) > best:
            target, best = history, len(items)
    if target is None:
        if not trajectory.messages_and_choices:
            target = trajectory
        else:
            target = History()
            trajectory.additional_histories.append(target)
    done = len(target.messages_and_choices)
    # A turn's messages and tools are JSON bodies, the dicts OpenAI's TypedDicts describe.
    new = cast(Messages, turn.messages[done:])
    target.messages_and_choices = [*target.messages_and_choices, *new, turn.choice]
    if done == 0:
        target.tools = cast(Tools, turn.tools)


class History(BaseModel):
    """Another conversation of the same rollout (e.g. a sub-agent), trained with its reward."""

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    messages_and_choices: MessagesAndChoicesField = []
    tools: ToolsField = None

    def messages(self) -> Messages:
        return get_messages(self.messages_and_choices)

    def as_chat_completions_history(self, *, model: str | None = None) -> _histories.ChatCompletionsHistory:
        """ART's view of it as a chat history (user-written messages: no sources)."""
        return _histories.legacy_as_chat(self, model=model)

    def tokenize(
        self,
        *,
        model: str,
        base_model: str | None = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        """Its token ids, logprobs and flags (`art.TokenizedHistory`): exact from its Choices' ids."""
        return tokenize_history(
            self,
            model=model,
            base_model=base_model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )


LegacyHistory = History
"""ART's newer name for `History` (its docs: `from art.trajectories import LegacyHistory`)."""

TrajectoryHistory = History | _histories.ExchangeHistory
"""Any history `Trajectory.history()` returns (ART's name)."""


class _CompactDump(BaseModel):
    """`model_dump()` leaves out fields still at their defaults, as ART's models do
    (`art.Trajectory().model_dump() == {}`); `exclude_defaults=False` gives every field."""

    def model_dump(self, *, exclude_defaults: bool = True, **kwargs: Any) -> dict[str, Any]:
        if exclude_defaults and "start_time" in type(self).model_fields:
            kwargs["exclude"] = _with_excluded(kwargs.get("exclude"), "start_time")
        return super().model_dump(exclude_defaults=exclude_defaults, **kwargs)


def _with_excluded(exclude: Any, name: str) -> Any:
    if exclude is None:
        return {name}
    if isinstance(exclude, set):
        return exclude | {name}
    if isinstance(exclude, dict):
        return {**exclude, name: True}
    return exclude


class Trajectory(_CompactDump):
    """One rollout: the conversation (message dicts and model `Choice`s), its reward and logs.

    `with art.Trajectory() as t:` records the model calls made inside into `t.exchanges` (and
    the turns they stand for into `messages_and_choices`); see `art.capture`.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    exchanges: TrajectoryExchanges = Field(default_factory=TrajectoryExchanges)
    """The model calls a capture recorded, each as sent and received (ART's field). A trajectory
    given only exchanges gets `messages_and_choices` from them: the turns that train."""
    messages_and_choices: MessagesAndChoicesField = []
    """Message dicts (context) and `Choice` objects (trained when they carry logprobs)."""
    tools: ToolsField = None
    """The tool definitions the model was given, as in an OpenAI request."""
    reward: float = 0.0
    """The scalar reward; must be finite."""
    metrics: dict[str, MetricValue] = {}
    """Numbers averaged per step by `model.log` (under `{split}/{key}`)."""
    metadata: dict[str, MetadataValue] = {}
    """Free-form JSON values stored with the trajectory (scenario id, ...), not averaged."""
    logs: list[str] = []
    additional_histories: list[History] = []
    start_time: datetime = Field(default_factory=datetime.now)
    end_time: datetime | None = None
    """Set by `finish()`; None while the rollout runs."""
    initial_policy_version: int | None = None
    """The training step whose weights sampled its oldest turn (ART's name): what its staleness
    is counted from. Set from the steps its calls report, else by `art.PipelineTrainer`."""
    final_policy_version: int | None = None
    """The step whose weights sampled its newest turn."""
    _built: bool = PrivateAttr(default=False)
    _entered_in: Any = PrivateAttr(default=None)
    """The group scope open where `with trajectory:` began: it joins that group when it ends."""

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"reward must be a finite number, got {value!r}")
        return value

    @model_validator(mode="after")
    def _turns_from_exchanges(self) -> Trajectory:
        # ART's representation (exchanges only): the turns that train are projected from them,
        # once, when the trajectory is built; later assignments leave the turns as they are set.
        if self._built:
            return self
        self._built = True
        if self.exchanges and not self.messages_and_choices and not self.additional_histories:
            for exchange in self.exchanges.in_order():
                try:
                    add_turn(self, chat_turn(exchange))
                except NotATurn:
                    continue
            date_from_choices(self)
        return self

    def __enter__(self) -> Trajectory:
        """Record the model calls made inside the block (this task and the tasks it starts)."""
        self._entered_in = current_group_scope()
        enter_scope(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Stop recording, date and finish the trajectory, and join the group it was entered in."""
        exit_scope(self)
        date_from_choices(self)
        self.finish()
        group, self._entered_in = self._entered_in, None
        if group is not None:
            group.trajectories.append(self)

    def messages(self) -> Messages:
        return get_messages(self.messages_and_choices)

    def finish(self) -> Trajectory:
        """Mark the rollout as done (sets `end_time`); returns self for `return traj.finish()`."""
        self.end_time = datetime.now()
        return self

    def log(self, message: str) -> None:
        self.logs.append(message)

    def for_logging(self) -> dict[str, Any]:
        """A JSON-serialisable dict of what trains and is logged; Choices are dumped whole (token
        ids, logprobs, extras). `exchanges` are left out: the turns hold what training needs."""
        return self.model_dump(mode="json", exclude_defaults=False, exclude={"exchanges"})

    @classmethod
    def from_logging(cls, data: Mapping[str, Any], where: str = "trajectory") -> Trajectory:
        """Inverse of `for_logging`: dumped Choices (no 'role', a 'message') become Choices again,
        extras such as token ids included. Invalid data raises TrajectoryError naming the field
        under `where` (the server reads every trained trajectory through here)."""

        def revive(items: list[Any], at: str) -> list[Any]:
            return [
                validated(Choice, item, f"{at}[{i}]")
                if isinstance(item, Mapping) and "role" not in item and "message" in item
                else item
                for i, item in enumerate(items)
            ]

        data = dict(data)
        data["messages_and_choices"] = revive(data.get("messages_and_choices", []), f"{where}.messages_and_choices")
        data["additional_histories"] = [
            {
                **h,
                "messages_and_choices": revive(
                    h.get("messages_and_choices", []), f"{where}.additional_histories[{i}].messages_and_choices"
                ),
            }
            for i, h in enumerate(data.get("additional_histories", []))
        ]
        return validated(cls, data, where)

    # -- ART's history views and tokenize (art.histories, art.tokenize) ------------------------
    # A trajectory with exchanges is read from them; one without, from its legacy histories.

    def legacy_histories(self) -> list[History]:
        """Copies of its main conversation (as a `History`) and its `additional_histories`: what
        `art.histories` reads when the trajectory has no exchanges."""
        main = History(messages_and_choices=copy.deepcopy(self.messages_and_choices), tools=copy.deepcopy(self.tools))
        return [main, *copy.deepcopy(self.additional_histories)]

    def history(self, *, model: str | None = None) -> Any:
        """The one history of the one API its (`model=`-selected) exchanges used; ValueError
        when there are several (then use `histories()`)."""
        return _all_histories.trajectory_history(self, model=model)

    def histories(self, *, model: str | None = None) -> list[Any]:
        return _all_histories.trajectory_histories(self, model=model)

    def chat_completions_history(self, *, model: str | None = None) -> _histories.ChatCompletionsHistory:
        return _histories.chat_completions_history(self, model=model)

    def chat_completions_histories(self, *, model: str | None = None) -> list[_histories.ChatCompletionsHistory]:
        return _histories.chat_completions_histories(self, model=model)

    def anthropic_messages_history(self, *, model: str | None = None) -> _histories.AnthropicMessagesHistory:
        return _histories.anthropic_messages_history(self, model=model)

    def anthropic_messages_histories(self, *, model: str | None = None) -> list[_histories.AnthropicMessagesHistory]:
        return _histories.anthropic_messages_histories(self, model=model)

    def responses_history(self, *, model: str | None = None) -> _histories.ResponsesHistory:
        return _histories.responses_history(self, model=model)

    def responses_histories(self, *, model: str | None = None) -> list[_histories.ResponsesHistory]:
        return _histories.responses_histories(self, model=model)

    def completions_token_history(self, *, model: str | None = None) -> _histories.CompletionsTokenHistory:
        return _completions.completions_token_history(self, model=model)

    def completions_token_histories(self, *, model: str | None = None) -> list[_histories.CompletionsTokenHistory]:
        return _completions.completions_token_histories(self, model=model)

    def completions_string_history(self, *, model: str | None = None) -> _histories.CompletionsStringHistory:
        return _completions.completions_string_history(self, model=model)

    def completions_string_histories(self, *, model: str | None = None) -> list[_histories.CompletionsStringHistory]:
        return _completions.completions_string_histories(self, model=model)

    def tokenize(
        self,
        *,
        multi_history: bool = False,
        model: str | None = None,
        base_model: str | None = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        """Its history's token ids, logprobs and flags (`art.TokenizedTrajectory`), or every
        history's (`multi_history=True`: `art.TokenizedMultiHistoryTrajectory`); see `art.tokenize`."""
        return tokenize_trajectory(
            self,
            multi_history=multi_history,
            model=model,
            base_model=base_model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )


def completion_tokens(trajectory: Trajectory) -> int:
    """Tokens its choices sampled, in every history (what the progress bars and throughput count)."""
    histories = [trajectory.messages_and_choices]
    histories += [h.messages_and_choices for h in trajectory.additional_histories]
    tokens = 0
    for item in (item for history in histories for item in history):
        if not is_choice(item):
            continue
        token_ids = getattr(item, "token_ids", None)
        if token_ids is None:  # an OpenAI-style server: one logprob entry per token
            token_ids = getattr(getattr(item, "logprobs", None), "content", None) or ()
        tokens += len(token_ids)
    return tokens


def validated(model: type[BaseModel], data: Any, where: str) -> Any:
    """`model.model_validate(data)`; the first problem raises TrajectoryError naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first.get("loc", ()))
        raise TrajectoryError(f"{where}{loc}: {first.get('msg', 'invalid')}", field=f"{where}{loc}") from None


def sampled_steps(trajectory: Trajectory) -> list[int]:
    """The training steps that sampled the trajectory's choices, as the server reported them
    (`step` on each choice), in every history; choices of other servers have none."""
    histories = [trajectory.messages_and_choices, *(h.messages_and_choices for h in trajectory.additional_histories)]
    steps = []
    for item in (item for history in histories for item in history):
        if is_choice(item):
            step = getattr(item, "step", None)
            extra = getattr(item, "model_extra", None)
            if step is None and isinstance(extra, dict):
                step = extra.get("step")
            if is_int(step):
                steps.append(step)
    return steps


def date_from_choices(trajectory: Trajectory) -> None:
    """Set the policy versions from the steps its choices report, unless already set."""
    steps = sampled_steps(trajectory)
    if steps and trajectory.initial_policy_version is None and trajectory.final_policy_version is None:
        object.__setattr__(trajectory, "initial_policy_version", min(steps))
        object.__setattr__(trajectory, "final_policy_version", max(steps))


def policy_versions(trajectory: Trajectory, started: int, ended: int) -> tuple[int, int]:
    """(initial, final) policy version of a rollout that began at trainer step `started` and
    ended at `ended`: the steps its choices say sampled them (a multi-turn trajectory whose
    turns span a weight update is as old as its oldest turn), else the steps it ran between."""
    steps = sampled_steps(trajectory)
    return (min(steps), max(steps)) if steps else (started, ended)


class ExceptionRecord(BaseModel):
    """A rollout exception kept for logging (the exception object itself is not serialisable)."""

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exception: BaseException) -> ExceptionRecord:
        return cls(
            type=type(exception).__name__,
            message=str(exception),
            traceback="".join(traceback.format_exception(type(exception), exception, exception.__traceback__)),
        )


PydanticException = ExceptionRecord  # upstream ART's name for the same record


class TrajectoryGroup(_CompactDump):
    """Trajectories of the same scenario, whose rewards are compared to compute advantages.

    Built from coroutines (`TrajectoryGroup(rollout(s) for _ in range(4))`) it is awaitable,
    once: `await group` runs them concurrently and returns the group, with failed rollouts in
    `exceptions`. Built from finished trajectories it is usable directly.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = []
    exceptions: list[ExceptionRecord] = []
    metadata: dict[str, MetadataValue] = {}
    metrics: dict[str, MetricValue] = {}
    logs: list[str] = []

    _items: list[Any] | None = PrivateAttr(default=None)
    _state: str = PrivateAttr(default="ready")  # ready | pending | running | done
    _size: int = PrivateAttr(default=0)  # rollouts given, while pending or running

    def __init__(
        self,
        trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]] = (),
        *,
        exceptions: Iterable[BaseException | ExceptionRecord | Mapping[str, str]] = (),
        metadata: Mapping[str, MetadataValue] | None = None,
        metrics: Mapping[str, MetricValue] | None = None,
        logs: Iterable[str] = (),
    ) -> None:
        if isinstance(trajectories, (Trajectory, Mapping)):
            raise TrajectoryError(
                "TrajectoryGroup takes a list of trajectories, not a single one", field="trajectories"
            )
        items, records = [], [_record(e) for e in exceptions]
        for item in trajectories:
            if isinstance(item, BaseException):
                records.append(ExceptionRecord.from_exception(item))
            else:
                items.append(item)
        awaitable = [inspect.isawaitable(item) and not isinstance(item, Trajectory) for item in items]
        super().__init__(
            trajectories=[item for item, is_aw in zip(items, awaitable) if not is_aw],
            exceptions=records,
            metadata=dict(metadata or {}),
            metrics=dict(metrics or {}),
            logs=list(logs),
        )
        if any(awaitable):
            finished = iter(self.trajectories)  # the finished ones (dicts now validated), in order
            self._items = [item if is_aw else next(finished) for item, is_aw in zip(items, awaitable)]
            self._state = "pending"
            self._size = len(self._items)

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __enter__(self) -> TrajectoryGroup:
        """Collect the trajectories whose `with art.Trajectory()` blocks close inside this one."""
        enter_group_scope(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        exit_group_scope(self)

    def __len__(self) -> int:
        """As ART counts a group: before it has run, every rollout it was given, awaitables
        included (ART's `_num_trajectories`); once awaited, its trajectories (failed rollouts
        went to `exceptions`)."""
        if self._state in ("pending", "running"):
            return self._size
        return len(self.trajectories)

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        return self._resolve().__await__()

    def discard(self) -> None:
        """Close the rollouts of a group that will never be awaited (skipped work), so Python
        does not warn that they were never awaited."""
        items, self._items = self._items or [], None
        for item in items:
            if inspect.iscoroutine(item):
                item.close()

    @property
    def pending(self) -> bool:
        """Built from coroutines and not awaited yet: `await group` runs its rollouts."""
        return self._state == "pending"

    async def _resolve(self) -> TrajectoryGroup:
        if self._state == "ready":
            return self
        if self._state != "pending":
            raise RuntimeError(
                "this TrajectoryGroup was already awaited: its rollouts run only once. Use the "
                "group itself (group.trajectories), or build a new group to sample again."
            )
        self._state = "running"
        items, self._items = self._items or [], None
        reporter = ROLLOUT_REPORTER.get()
        if reporter is not None:
            reporter.expect(self, len(items))
        with tracing.span("art.group", {"openinference.span.kind": "CHAIN", "art.rollouts": len(items)}) as current:
            try:
                results = await run_rollouts(items, reporter, Trajectory)
            finally:
                self._state = "done"
            if current is not None:
                rewards = [r.reward for r in results if isinstance(r, Trajectory)]
                tracing.set_attributes(
                    current,
                    {
                        "art.exceptions": sum(isinstance(r, BaseException) for r in results),
                        "art.reward_mean": sum(rewards) / len(rewards) if rewards else None,
                    },
                )
        self.trajectories = [r for r in results if isinstance(r, Trajectory)]
        self.exceptions = self.exceptions + [
            ExceptionRecord.from_exception(r) for r in results if isinstance(r, BaseException)
        ]
        return self

    def for_logging(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the group and its trajectories."""
        return {
            "trajectories": [t.for_logging() for t in self.trajectories],
            "exceptions": [e.model_dump(mode="json") for e in self.exceptions],
            "metadata": to_jsonable_python(self.metadata, serialize_unknown=True),
            "metrics": to_jsonable_python(self.metrics, serialize_unknown=True),
            "logs": list(self.logs),
        }

    def tokenize(
        self,
        *,
        multi_history: bool = False,
        model: str | None = None,
        base_model: str | None = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> TokenizedTrajectoryGroup:
        """Each trajectory's `tokenize(...)`, with the group's metrics and metadata."""
        return tokenize_group(
            self,
            multi_history=multi_history,
            model=model,
            base_model=base_model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )


def _record(exception: BaseException | ExceptionRecord | Mapping[str, str]) -> ExceptionRecord:
    if isinstance(exception, BaseException):
        return ExceptionRecord.from_exception(exception)
    if isinstance(exception, ExceptionRecord):
        return exception
    return ExceptionRecord.model_validate(exception)
