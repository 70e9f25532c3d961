"""Summary metrics of logged trajectories (ART's names), the builder of a step's metrics, and
`track_api_cost`, which charges an API call (a judge's, a tool model's) to the active builder;
all on the client side."""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from art.costs import CostExtractor, TokenPricing, api_call_cost
from art.metrics_taxonomy import CumulativeTotals, is_cumulative


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(groups) -> dict[str, float]:
    """reward, reward_std_dev (mean within-group std), exception_rate, every trajectory metric
    averaged, group metrics as `group_<key>`, and counts."""
    rewards: list[float] = []
    stds: list[float] = []
    per_metric: dict[str, list[float]] = defaultdict(list)
    exceptions = 0
    trajectories = 0
    for group in groups:
        group_rewards = [float(t.reward) for t in group.trajectories]
        rewards += group_rewards
        trajectories += len(group_rewards)
        exceptions += len(getattr(group, "exceptions", None) or [])
        if group_rewards:
            mean = _mean(group_rewards)
            stds.append(math.sqrt(_mean([(r - mean) ** 2 for r in group_rewards])))
        for t in group.trajectories:
            for key, value in (t.metrics or {}).items():
                if isinstance(value, (int, float)):
                    per_metric[key].append(float(value))
        for key, value in (getattr(group, "metrics", None) or {}).items():
            if isinstance(value, (int, float)):
                per_metric[f"group_{key}"].append(float(value))
    out = {
        "reward": _mean(rewards),
        "reward_std_dev": _mean(stds),
        "exception_rate": exceptions / (exceptions + trajectories) if exceptions + trajectories else 0.0,
        "num_groups": float(len(stds)),
        "num_trajectories": float(trajectories),
    }
    out.update({key: _mean(values) for key, values in per_metric.items()})
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}


def data_counts(groups) -> dict[str, float]:
    """ART's `data/step_*` counts of a train step's groups: scenarios (one per group), rollouts
    (failed ones included), groups submitted and groups whose rewards differ (trainable)."""
    groups = list(groups)
    trainable = sum(1 for g in groups if len({float(t.reward) for t in g.trajectories}) > 1)
    rollouts = sum(len(g.trajectories) + len(getattr(g, "exceptions", None) or []) for g in groups)
    return {
        "data/step_num_scenarios": float(len(groups)),
        "data/step_num_trajectories": float(rollouts),
        "data/step_num_groups_submitted": float(len(groups)),
        "data/step_num_groups_trainable": float(trainable),
    }


def group_scenario_ids(groups) -> list[str]:
    """Each group's `scenario_id` metadata (its own, else its first trajectory's that has one)."""
    ids: list[str] = []
    for group in groups:
        for metadata in (getattr(group, "metadata", None) or {}, *((t.metadata or {}) for t in group.trajectories)):
            if metadata.get("scenario_id") is not None:
                ids.append(str(metadata["scenario_id"]))
                break
    return list(dict.fromkeys(ids))


# -- step metrics built up while a step runs (ART's MetricsBuilder) ---------------------------------

_ACTIVE: contextvars.ContextVar[MetricsBuilder] = contextvars.ContextVar("art_metrics_builder")

F = TypeVar("F", bound=Callable[..., Any])

EVAL_CONTEXT = "eval"
"""The cost context of evaluation (ART's): `model.log(split="val")` (or "test") writes it."""


@dataclass
class _Pending:
    metrics: dict[str, float] = field(default_factory=dict)
    scenario_ids: set[str] = field(default_factory=set)


@dataclass
class SharedMetrics:
    """What every builder of one model shares: the pending metrics of each buffer (a context or
    split), the prices and extractors `add_response_cost` uses, and the running totals `flush`
    reports (this process's; history keeps its own where it is written)."""

    pending: dict[str, _Pending] = field(default_factory=dict)
    pricing: dict[str, TokenPricing] = field(default_factory=dict)
    extractors: dict[str, CostExtractor] = field(default_factory=dict)
    totals: CumulativeTotals = field(default_factory=CumulativeTotals)


class MetricsBuilder:
    """Collects one step's metrics as they happen, for the next `model.log` of its split.

        builder = model.metrics_builder("train")
        with builder.activate_context():        # completions through model.openai_client() add costs,
            ...                                 # and so does every @track_api_cost call
            builder.add_data(step_actor_tokens=n, scenario_ids=[scenario.id])
        await model.log(groups, split="train")  # takes what the builder holds

    Keys need a section (`data/…`, `time/…`, `costs/…`); running totals (`*/cum/*`), roll-ups
    of costs and throughput are derived where the row is written, so they survive restarts."""

    def __init__(
        self, cost_context: str = "train", *, shared: SharedMetrics | None = None, buffer_scope: str | None = None
    ) -> None:
        """`shared`: the state of one model's builders (`Model.metrics_builder` passes its own);
        `buffer_scope`: the buffer written to, when not the cost context's."""
        self.cost_context = _name(cost_context, "cost_context")
        self._scope = self.cost_context if buffer_scope is None else _name(buffer_scope, "buffer_scope")
        self._shared = shared if shared is not None else SharedMetrics()

    # -- adding -------------------------------------------------------------------------------
    def add_metric(self, key: str, value: float) -> None:
        """Add `value` to `key` for this step (repeated calls sum)."""
        if "/" not in key:
            raise ValueError(f"metric key {key!r} needs a section prefix, such as 'data/{key}' or 'time/{key}'")
        if is_cumulative(key):
            raise ValueError(f"metric key {key!r} is in the reserved cumulative namespace: running totals are derived")
        buffer = self._pending().metrics
        for other in buffer:
            if other != key and (other.startswith(f"{key}/") or key.startswith(f"{other}/")):
                raise ValueError(
                    f"cannot log {key!r} beside {other!r}: one nests under the other, and only "
                    "leaves are logged (parents are summed from them)"
                )
        buffer[key] = buffer.get(key, 0.0) + float(value)

    def add_cost(self, path: str, usd: float) -> None:
        if not path or not path.strip("/"):
            raise ValueError("cost path must be non-empty, such as 'train/judge'")
        self.add_metric(f"costs/{path.strip('/')}", usd)

    def add_data(
        self,
        step_num_scenarios: int | None = None,
        step_actor_tokens: int | None = None,
        scenario_ids: list[str] | None = None,
    ) -> None:
        if step_num_scenarios is not None:
            self.add_metric("data/step_num_scenarios", step_num_scenarios)
        if step_actor_tokens is not None:
            self.add_metric("data/step_actor_tokens", step_actor_tokens)
        if scenario_ids is not None:
            self._pending().scenario_ids.update(str(s) for s in scenario_ids)

    def add_user_timing(
        self, step_wall_s: float | None = None, step_actor_s: float | None = None, step_eval_s: float | None = None
    ) -> None:
        for name, value in (("wall", step_wall_s), ("actor", step_actor_s), ("eval", step_eval_s)):
            if value is not None:
                self.add_metric(f"time/step_{name}_s", value)

    def add_idle_times(self, step_trainer_idle_s: float | None = None, step_actor_idle_s: float | None = None) -> None:
        for name, value in (("trainer", step_trainer_idle_s), ("actor", step_actor_idle_s)):
            if value is not None:
                self.add_metric(f"throughput/step_{name}_idle_s", value)

    @contextmanager
    def measure(self, key: str):
        """`with builder.measure("time/step_actor_s"):` adds the block's wall seconds."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.add_metric(key, time.monotonic() - began)

    # -- API costs ----------------------------------------------------------------------------
    def register_model_pricing(
        self,
        model_name: str,
        *,
        prompt_per_million: float,
        completion_per_million: float,
        cached_prompt_per_million: float | None = None,
        cache_creation_per_million: float | None = None,
        cache_read_per_million: float | None = None,
    ) -> None:
        """Prices (dollars per million tokens) `add_response_cost` uses for `model_name`, before
        the built-in tables; cache prices left None cost as prompt tokens."""
        if not model_name or not model_name.strip():
            raise ValueError("model_name must be non-empty, such as 'anthropic/claude-sonnet-4-6'")
        prices = {
            "prompt_per_million": prompt_per_million,
            "completion_per_million": completion_per_million,
            "cached_prompt_per_million": cached_prompt_per_million,
            "cache_creation_per_million": cache_creation_per_million,
            "cache_read_per_million": cache_read_per_million,
        }
        bad = [name for name, value in prices.items() if value is not None and not float(value) >= 0]
        if bad:
            raise ValueError(f"{', '.join(bad)} must be a number >= 0 (dollars per million tokens)")
        checked: dict[str, Any] = {name: None if value is None else float(value) for name, value in prices.items()}
        self._shared.pricing[model_name.strip()] = TokenPricing(**checked)

    def register_cost_extractor(self, provider: str, extractor: CostExtractor) -> None:
        """Price `provider`'s responses with `extractor(response) -> dollars` (None falls through
        to token pricing); for a provider whose usage is not OpenAI's or Anthropic's."""
        if not provider or not provider.strip():
            raise ValueError("provider must be non-empty, such as 'openai'")
        if not callable(extractor):
            raise ValueError(f"extractor must be callable (response -> dollars), got {type(extractor).__name__}")
        self._shared.extractors[provider.strip().lower()] = extractor

    def add_response_cost(
        self,
        source: str,
        response: Any,
        *,
        provider: str,
        model_name: str,
        prompt_price_per_million: float | None = None,
        completion_price_per_million: float | None = None,
        cached_prompt_price_per_million: float | None = None,
        cache_creation_price_per_million: float | None = None,
        cache_read_price_per_million: float | None = None,
    ) -> float:
        """Add what an API response cost under `costs/<cost_context>/<source>` and return it
        (`art.costs.api_call_cost` says how it is found; ValueError when it cannot be)."""
        if not source or not source.strip("/ "):
            raise ValueError("source must be non-empty, such as 'llm_judge/correctness'")
        cost = api_call_cost(
            response,
            provider=provider,
            model_name=model_name,
            cost_extractors=self._shared.extractors,
            model_pricing=self._shared.pricing,
            overrides={
                "prompt_per_million": prompt_price_per_million,
                "completion_per_million": completion_price_per_million,
                "cached_prompt_per_million": cached_prompt_price_per_million,
                "cache_creation_per_million": cache_creation_price_per_million,
                "cache_read_per_million": cache_read_price_per_million,
            },
        )
        self.add_cost(f"{self.cost_context}/{source.strip('/ ')}", cost)
        return cost

    # -- reading ------------------------------------------------------------------------------
    async def flush(self) -> dict[str, float]:
        """This buffer's metrics so far, emptied, with their cost roll-ups and this process's
        running totals (`costs/cum/...`, as ART's). Scenario ids stay for the next `model.log`;
        a history row derives its own totals, which survive restarts."""
        pending = self._pending()
        out = dict(pending.metrics)
        pending.metrics.clear()
        out.update(self._shared.totals.derive(out))
        return out

    def take(self) -> tuple[dict[str, float], list[str]]:
        """What `model.log(split=<this builder's context>)` writes: the pending metrics and
        scenario ids, emptied; for "val" and "test", those of the "eval" context too (ART's)."""
        scopes = [self._scope] + ([EVAL_CONTEXT] if self._scope in ("val", "test") else [])
        metrics: dict[str, float] = {}
        ids: set[str] = set()
        for scope in scopes:
            pending = self._shared.pending.pop(scope, None) or _Pending()
            for key, value in pending.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
            ids |= pending.scenario_ids
        return metrics, sorted(ids)

    def state_dict(self) -> dict[str, Any]:
        """The running totals `flush` reports, as JSON (ART's `cum_state`, `unique_scenario_ids`)."""
        return self._shared.totals.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s totals; pending metrics are dropped."""
        self._shared.totals = CumulativeTotals(state)
        self._shared.pending.clear()

    # -- context ------------------------------------------------------------------------------
    def activate(self) -> contextvars.Token:
        """Make this the active builder; undo with `token.var.reset(token)`."""
        return _ACTIVE.set(self)

    @contextmanager
    def activate_context(self):
        token = self.activate()
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @staticmethod
    def get_active() -> MetricsBuilder:
        """The builder activated in this context; LookupError outside one (as in ART)."""
        return _ACTIVE.get()

    def for_cost_context(self, cost_context: str, *, buffer_scope: str | None = None) -> MetricsBuilder:
        """A builder for another context (split) of the same model, sharing prices, extractors
        and totals; `buffer_scope` names the pending buffer when it is not the context's own."""
        return MetricsBuilder(cost_context, shared=self._shared, buffer_scope=buffer_scope)

    def _pending(self) -> _Pending:
        return self._shared.pending.setdefault(self._scope, _Pending())


def active_builder() -> MetricsBuilder | None:
    return _ACTIVE.get(None)


def track_api_cost(
    *,
    source: str,
    provider: str,
    model_name: str,
    response_getter: Callable[[Any], Any] | None = None,
    prompt_price_per_million: float | None = None,
    completion_price_per_million: float | None = None,
    cached_prompt_price_per_million: float | None = None,
    cache_creation_price_per_million: float | None = None,
    cache_read_price_per_million: float | None = None,
) -> Callable[[F], F]:
    """Decorate a function (sync or async) that calls an API: each call's response is charged
    to the active builder under `costs/<cost_context>/<source>` (ART's decorator).

        @track_api_cost(source="llm_judge/correctness", provider="openai", model_name="openai/gpt-4.1")
        async def judge(question: str) -> ChatCompletion: ...

    Outside an active builder a call is charged nowhere. `response_getter(result)` picks the
    response out of what the function returns; the prices replace the model's table prices."""
    for name, value in (
        ("source", source.strip("/ ") if isinstance(source, str) else source),
        ("provider", provider),
        ("model_name", model_name),
    ):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"track_api_cost: {name} must be a non-empty string, got {value!r}")
    prices = {
        "prompt_price_per_million": prompt_price_per_million,
        "completion_price_per_million": completion_price_per_million,
        "cached_prompt_price_per_million": cached_prompt_price_per_million,
        "cache_creation_price_per_million": cache_creation_price_per_million,
        "cache_read_price_per_million": cache_read_price_per_million,
    }

    def charge(result: Any) -> None:
        builder = active_builder()
        if builder is not None:
            response = response_getter(result) if response_getter is not None else result
            builder.add_response_cost(source, response, provider=provider, model_name=model_name, **prices)

    def decorate(func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def charged_async(*args, **kwargs):
                result = await func(*args, **kwargs)
                charge(result)
                return result

            return cast(F, charged_async)

        @functools.wraps(func)
        def charged(*args, **kwargs):
            result = func(*args, **kwargs)
            charge(result)
            return result

        return cast(F, charged)

    return decorate


def _name(value: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip("/ "):
        raise ValueError(f"{what} must be a non-empty name such as 'train' or 'eval', got {value!r}")
    return value.strip("/ ")
