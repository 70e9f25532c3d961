"""What tokens cost: per-model prices and the calculator `Model.set_cost_calculator` takes.

    pricing = art.costs.get_model_pricing("Qwen/Qwen3-8B")          # or ModelPricing(...) of your own
    model.set_cost_calculator(art.costs.build_cost_calculator(pricing))
    with model.metrics_builder("train").activate_context():
        await model.openai_client().chat.completions.create(...)     # adds costs/train/tinker_*

The table holds ART's hosted (Tinker) prices in dollars per million tokens, which is why the
keys a calculator returns are named `tinker_prefill` and `tinker_sample`, as in ART.

The second half prices calls to other APIs (an LLM judge, a tool model) from their responses:
`TokenPricing` per API model, cache reads and writes included, and `api_call_cost`, which
`art.metrics.track_api_cost` and `MetricsBuilder.add_response_cost` use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelPricing:
    """Dollars per million tokens: prompt (prefill), completion (sample) and training."""

    prefill: float
    sample: float
    train: float


CostCalculator = Callable[..., dict[str, float]]
"""`(prompt_tokens, completion_tokens, cost_context="train") -> {"costs/<context>/tinker_prefill": $, ...}`"""

MODEL_PRICING: dict[str, ModelPricing] = {
    "Qwen/Qwen3-4B-Instruct-2507": ModelPricing(0.07, 0.22, 0.22),
    "Qwen/Qwen3-8B": ModelPricing(0.13, 0.40, 0.40),
    "Qwen/Qwen3-8B-Base": ModelPricing(0.13, 0.40, 0.40),
    "Qwen/Qwen3-30B-A3B": ModelPricing(0.12, 0.30, 0.36),
    "Qwen/Qwen3-30B-A3B-Base": ModelPricing(0.12, 0.30, 0.36),
    "Qwen/Qwen3-30B-A3B-Instruct-2507": ModelPricing(0.12, 0.30, 0.36),
    "Qwen/Qwen3-32B": ModelPricing(0.49, 1.47, 1.47),
    "Qwen/Qwen3-235B-A22B-Instruct-2507": ModelPricing(0.68, 1.70, 2.04),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": ModelPricing(0.18, 0.44, 0.53),
    "Qwen/Qwen3-VL-235B-A22B-Instruct": ModelPricing(1.02, 2.56, 3.07),
    "meta-llama/Llama-3.2-1B": ModelPricing(0.03, 0.09, 0.09),
    "meta-llama/Llama-3.2-3B": ModelPricing(0.06, 0.18, 0.18),
    "meta-llama/Llama-3.1-8B": ModelPricing(0.13, 0.40, 0.40),
    "meta-llama/Llama-3.1-8B-Instruct": ModelPricing(0.13, 0.40, 0.40),
    "meta-llama/Llama-3.1-70B": ModelPricing(1.05, 3.16, 3.16),
    "meta-llama/Llama-3.3-70B-Instruct": ModelPricing(1.05, 3.16, 3.16),
    "deepseek-ai/DeepSeek-V3.1": ModelPricing(1.13, 2.81, 3.38),
    "deepseek-ai/DeepSeek-V3.1-Base": ModelPricing(1.13, 2.81, 3.38),
    "openai/gpt-oss-120b": ModelPricing(0.18, 0.44, 0.52),
    "openai/gpt-oss-20b": ModelPricing(0.12, 0.30, 0.36),
    "moonshotai/Kimi-K2-Thinking": ModelPricing(0.98, 2.44, 2.93),
}


def get_model_pricing(model_name: str | None, *, strict: bool = False) -> ModelPricing | None:
    """The model's prices, or None when the table has none (`strict=True` raises instead)."""
    pricing = MODEL_PRICING.get(model_name) if model_name is not None else None
    if pricing is None and strict:
        raise ValueError(
            f"no pricing for model {model_name!r}: pass a ModelPricing of your own to "
            f"build_cost_calculator, or add it to art.costs.MODEL_PRICING (known: {', '.join(MODEL_PRICING)})"
        )
    return pricing


def tokens_to_cost(num_tokens: float, price_per_million: float) -> float:
    return float(num_tokens) * price_per_million / 1_000_000


def compute_sample_costs(
    *, prompt_tokens: int | None, completion_tokens: int | None, pricing: ModelPricing, cost_context: str = "train"
) -> dict[str, float]:
    """The cost of one request's prompt and completion tokens, under `costs/<cost_context>/`."""
    if not cost_context or not cost_context.strip("/"):
        raise ValueError("cost_context must be a non-empty name such as 'train' or 'eval'")
    prefix = f"costs/{cost_context.strip('/')}"
    return {
        f"{prefix}/tinker_prefill": tokens_to_cost(prompt_tokens or 0, pricing.prefill),
        f"{prefix}/tinker_sample": tokens_to_cost(completion_tokens or 0, pricing.sample),
    }


def build_cost_calculator(pricing: ModelPricing) -> CostCalculator:
    """A calculator for `Model.set_cost_calculator`: `(prompt_tokens, completion_tokens,
    cost_context="train")` -> the request's costs by key."""

    def calculate(
        prompt_tokens: int | None, completion_tokens: int | None, cost_context: str = "train"
    ) -> dict[str, float]:
        return compute_sample_costs(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, pricing=pricing, cost_context=cost_context
        )

    return calculate


def compute_train_cost(train_tokens: float, pricing: ModelPricing) -> float:
    return tokens_to_cost(train_tokens, pricing.train)


# -- what an API call cost: a judge's, a tool model's (ART's art.api_costs) -------------------------


@dataclass(frozen=True)
class TokenPricing:
    """Dollars per million tokens of one API model, for `MetricsBuilder.add_response_cost` and
    `art.metrics.track_api_cost`. A cache price of None means the prompt price."""

    prompt_per_million: float
    """Prompt (input) tokens read fresh."""
    completion_per_million: float
    """Completion (output) tokens."""
    cached_prompt_per_million: float | None = None
    """OpenAI: prompt tokens served from its prompt cache (`usage.prompt_tokens_details.cached_tokens`)."""
    cache_creation_per_million: float | None = None
    """Anthropic: tokens written to its cache (`usage.cache_creation_input_tokens`)."""
    cache_read_per_million: float | None = None
    """Anthropic: tokens read from its cache (`usage.cache_read_input_tokens`)."""


MODEL_TOKEN_PRICING: dict[str, TokenPricing] = {
    "openai/gpt-4.1": TokenPricing(2.0, 8.0, cached_prompt_per_million=0.5),
    "anthropic/claude-sonnet-4-6": TokenPricing(
        3.0, 15.0, cache_creation_per_million=3.75, cache_read_per_million=0.30
    ),
}
"""API models priced out of the box, by `provider/model` (ART's table); `register_model_pricing`
or this dict adds more."""

CostExtractor = Callable[[Any], "float | None"]
"""`response -> dollars` for a provider whose usage this module cannot read; None falls through
to pricing by tokens."""

OPENAI, ANTHROPIC = "openai", "anthropic"
"""The providers whose usage is read here: OpenAI's (Chat Completions and Responses: OpenRouter,
vLLM and our server answer the same shape) and Anthropic's Messages."""


def token_pricing(model_name: str, registered: Mapping[str, TokenPricing] | None = None) -> TokenPricing | None:
    """The first price found for `model_name`: `registered`, `MODEL_TOKEN_PRICING`, the hosted
    table (`MODEL_PRICING`: prefill and sample), then LiteLLM's model table when it is installed."""
    found = (registered or {}).get(model_name) or MODEL_TOKEN_PRICING.get(model_name)
    if found is not None:
        return found
    hosted = MODEL_PRICING.get(model_name)
    if hosted is not None:
        return TokenPricing(hosted.prefill, hosted.sample)
    return _litellm_pricing(model_name)


def _litellm_pricing(model_name: str) -> TokenPricing | None:
    try:
        from litellm import get_model_info  # optional: not a dependency of ours

        info = get_model_info(model_name)
    except Exception:  # not installed, or the model is unknown to it
        return None

    def per_million(field: str) -> float | None:
        value = info.get(field) if isinstance(info, Mapping) else None
        return None if value is None or isinstance(value, bool) else float(value) * 1_000_000

    prompt, completion = per_million("input_cost_per_token"), per_million("output_cost_per_token")
    if prompt is None or completion is None:
        return None
    read = per_million("cache_read_input_token_cost")
    return TokenPricing(
        prompt,
        completion,
        cached_prompt_per_million=read,
        cache_creation_per_million=per_million("cache_creation_input_token_cost"),
        cache_read_per_million=read,
    )


def api_call_cost(
    response: Any,
    *,
    provider: str,
    model_name: str,
    overrides: Mapping[str, float | None] | None = None,
    cost_extractors: Mapping[str, CostExtractor] | None = None,
    model_pricing: Mapping[str, TokenPricing] | None = None,
) -> float:
    """What one API response cost, in dollars, found in this order (ART's):

    1. the cost the provider reported: `usage.cost` (OpenRouter; a number or `{"total_cost": x}`),
       `usage.model_extra["cost"]`, or LiteLLM's response-cost header;
    2. the extractor registered for `provider`, unless it returns None;
    3. the tokens in `usage` times the model's prices (`token_pricing`, each field replaced by a
       non-None `overrides[field]`), for the `openai` and `anthropic` usage shapes.

    ValueError when none applies, naming what is missing."""
    if not provider or not provider.strip():
        raise ValueError("provider must be non-empty, such as 'openai' or 'anthropic'")
    if not model_name or not model_name.strip():
        raise ValueError("model_name must be non-empty, such as 'openai/gpt-4.1'")
    provider, model_name = provider.strip().lower(), model_name.strip()
    reported = reported_cost(response)
    if reported is not None:
        return reported
    extractor = (cost_extractors or {}).get(provider)
    if extractor is not None and (custom := extractor(response)) is not None:
        return float(custom)
    pricing = _pricing_with(model_name, overrides or {}, model_pricing or {})
    usage = _read(response, "usage")
    cost = (
        _openai_cost(usage, pricing)
        if provider == OPENAI
        else _anthropic_cost(usage, pricing)
        if provider == ANTHROPIC
        else None
    )
    if cost is not None:
        return cost
    if provider in (OPENAI, ANTHROPIC):
        raise ValueError(
            f"Response usage does not match provider {provider!r}: the response has no token "
            "counts of that shape; pass the provider that answered, or register_cost_extractor"
        )
    raise ValueError(
        f"No cost extractor registered for provider {provider!r}: its responses report no "
        "usage.cost, so MetricsBuilder.register_cost_extractor(provider, fn) must price them"
    )


def reported_cost(response: Any) -> float | None:
    """The dollars a provider put in the response itself, or None."""
    usage = _read(response, "usage")
    for value in (
        _read(usage, "cost"),
        _read(_read(usage, "model_extra"), "cost"),
        _read(_read(_read(response, "_hidden_params"), "additional_headers"), "llm_provider-x-litellm-response-cost"),
    ):
        cost = _number(value)
        if cost is None:
            cost = _number(_read(value, "total_cost"))
        if cost is not None:
            return cost
    return None


def _pricing_with(
    model_name: str, overrides: Mapping[str, float | None], registered: Mapping[str, TokenPricing]
) -> TokenPricing:
    given = {field: float(value) for field, value in overrides.items() if value is not None}
    unknown = set(given) - set(TokenPricing.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown price field(s) {sorted(unknown)}; known: {list(TokenPricing.__dataclass_fields__)}")
    base = token_pricing(model_name, registered)
    if base is None:
        if {"prompt_per_million", "completion_per_million"} <= given.keys():  # fully priced by the caller
            return TokenPricing(**given)
        raise ValueError(
            f"No pricing configured for model {model_name!r}: register it with "
            "MetricsBuilder.register_model_pricing(), add it to art.costs.MODEL_TOKEN_PRICING, "
            "or pass prompt_price_per_million and completion_price_per_million"
        )
    return replace(base, **given)


def _openai_cost(usage: Any, pricing: TokenPricing) -> float | None:
    prompt = _count(usage, "prompt_tokens", "input_tokens")
    completion = _count(usage, "completion_tokens", "output_tokens")
    cached = (
        _number(_read(_read(usage, "prompt_tokens_details"), "cached_tokens"))
        or _number(_read(_read(usage, "input_tokens_details"), "cached_tokens"))
        or 0.0
    )
    if prompt is None and completion is None and not cached:
        return None
    prompt = prompt or 0.0
    cached = min(cached, prompt)  # cached tokens are part of the prompt count
    cached_price = pricing.cached_prompt_per_million
    return (
        tokens_to_cost(prompt - cached, pricing.prompt_per_million)
        + tokens_to_cost(cached, pricing.prompt_per_million if cached_price is None else cached_price)
        + tokens_to_cost(completion or 0.0, pricing.completion_per_million)
    )


def _anthropic_cost(usage: Any, pricing: TokenPricing) -> float | None:
    fresh, output = _count(usage, "input_tokens"), _count(usage, "output_tokens")
    written = _number(_read(usage, "cache_creation_input_tokens")) or 0.0
    read = _number(_read(usage, "cache_read_input_tokens")) or 0.0
    if fresh is None and output is None and not written and not read:
        return None
    prompt = pricing.prompt_per_million

    def price(value: float | None) -> float:
        return prompt if value is None else value

    return (
        tokens_to_cost(fresh or 0.0, prompt)
        + tokens_to_cost(written, price(pricing.cache_creation_per_million))
        + tokens_to_cost(read, price(pricing.cache_read_per_million))
        + tokens_to_cost(output or 0.0, pricing.completion_per_million)
    )


def _count(usage: Any, *names: str) -> float | None:
    for name in names:
        value = _number(_read(usage, name))
        if value is not None:
            return value
    return None


def _read(container: Any, name: str) -> Any:
    if container is None:
        return None
    if isinstance(container, Mapping):
        return container.get(name)
    return getattr(container, name, None)


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
