"""Summary metrics of logged trajectories (ART's names) and the builder of a step's metrics, both on
the client side."""

from __future__ import annotations

import contextvars
import math
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from art.metrics_taxonomy import cost_rollups, is_cumulative


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
    return {"data/step_num_scenarios": float(len(groups)), "data/step_num_trajectories": float(rollouts),
            "data/step_num_groups_submitted": float(len(groups)), "data/step_num_groups_trainable": float(trainable)}


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


@dataclass
class _Pending:
    metrics: dict[str, float] = field(default_factory=dict)
    scenario_ids: set[str] = field(default_factory=set)


@dataclass
class _Shared:
    """What every builder of one model shares: the pending metrics of each context (split), and
    prices registered for `add_response_cost`."""

    pending: dict[str, _Pending] = field(default_factory=dict)
    pricing: dict[str, tuple[float, float]] = field(default_factory=dict)


class MetricsBuilder:
    """Collects one step's metrics as they happen, for the next `model.log` of its split.

        builder = model.metrics_builder("train")
        with builder.activate_context():        # completions through model.openai_client() add costs
            ...
            builder.add_data(step_actor_tokens=n, scenario_ids=[scenario.id])
        await model.log(groups, split="train")  # takes what the builder holds

    Keys need a section (`data/…`, `time/…`, `costs/…`); running totals (`*/cum/*`), roll-ups
    of costs and throughput are derived where the row is written, so they survive restarts."""

    def __init__(self, cost_context: str = "train", *, _shared: _Shared | None = None) -> None:
        if not cost_context or not cost_context.strip("/ "):
            raise ValueError("cost_context must be a non-empty name such as 'train' or 'eval'")
        self.cost_context = cost_context.strip("/ ")
        self._shared = _shared if _shared is not None else _Shared()

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
                raise ValueError(f"cannot log {key!r} beside {other!r}: one nests under the other, and only "
                                 "leaves are logged (parents are summed from them)")
        buffer[key] = buffer.get(key, 0.0) + float(value)

    def add_cost(self, path: str, usd: float) -> None:
        if not path or not path.strip("/"):
            raise ValueError("cost path must be non-empty, such as 'train/judge'")
        self.add_metric(f"costs/{path.strip('/')}", usd)

    def add_data(self, step_num_scenarios: int | None = None, step_actor_tokens: int | None = None,
                 scenario_ids: list[str] | None = None) -> None:
        if step_num_scenarios is not None:
            self.add_metric("data/step_num_scenarios", step_num_scenarios)
        if step_actor_tokens is not None:
            self.add_metric("data/step_actor_tokens", step_actor_tokens)
        if scenario_ids is not None:
            self._pending().scenario_ids.update(str(s) for s in scenario_ids)

    def add_user_timing(self, step_wall_s: float | None = None, step_actor_s: float | None = None,
                        step_eval_s: float | None = None) -> None:
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

    def register_model_pricing(self, model_name: str, *, prompt_per_million: float,
                               completion_per_million: float, **_cache_prices: float | None) -> None:
        """Prices `add_response_cost` uses for `model_name` (cache prices are accepted, not used)."""
        if not model_name.strip():
            raise ValueError("model_name must be non-empty")
        self._shared.pricing[model_name.strip()] = (float(prompt_per_million), float(completion_per_million))

    def add_response_cost(self, source: str, response: Any, *, provider: str | None = None,
                          model_name: str | None = None, prompt_price_per_million: float | None = None,
                          completion_price_per_million: float | None = None, **_cache_prices: float | None,
                          ) -> float | None:
        """Add what an API response (OpenAI chat or Responses, Anthropic: anything with `usage`)
        cost under `costs/<cost_context>/<source>`; None, adding nothing, without usage or prices."""
        if not source or not source.strip("/"):
            raise ValueError("source must be non-empty, such as 'judge'")
        prices = self._shared.pricing.get((model_name or "").strip())
        prompt_price = prompt_price_per_million if prompt_price_per_million is not None else prices and prices[0]
        completion_price = (completion_price_per_million if completion_price_per_million is not None
                            else prices and prices[1])
        usage = _field(response, "usage")
        if usage is None or prompt_price is None or completion_price is None:
            return None
        prompt = _field(usage, "prompt_tokens", _field(usage, "input_tokens", 0)) or 0
        completion = _field(usage, "completion_tokens", _field(usage, "output_tokens", 0)) or 0
        cost = (prompt * prompt_price + completion * completion_price) / 1_000_000
        self.add_cost(f"{self.cost_context}/{source.strip('/')}", cost)
        return cost

    # -- reading ------------------------------------------------------------------------------
    async def flush(self) -> dict[str, float]:
        """This context's metrics so far with their cost roll-ups, emptied (scenario ids stay for
        the next `model.log`). Running totals are not here: the history row has them."""
        pending = self._pending()
        out = dict(pending.metrics)
        pending.metrics.clear()
        out.update(cost_rollups(out))
        return out

    def take(self) -> tuple[dict[str, float], list[str]]:
        """What `model.log` writes: the pending metrics and scenario ids, emptied."""
        pending = self._shared.pending.pop(self.cost_context, None) or _Pending()
        return pending.metrics, sorted(pending.scenario_ids)

    # -- context ------------------------------------------------------------------------------
    def activate(self) -> contextvars.Token:
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

    def for_cost_context(self, cost_context: str) -> MetricsBuilder:
        """A builder for another context (split) of the same model."""
        return MetricsBuilder(cost_context, _shared=self._shared)

    def _pending(self) -> _Pending:
        return self._shared.pending.setdefault(self.cost_context, _Pending())


def active_builder() -> MetricsBuilder | None:
    return _ACTIVE.get(None)


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)
