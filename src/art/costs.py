"""What tokens cost: per-model prices and the calculator `Model.set_cost_calculator` takes.

    pricing = art.costs.get_model_pricing("Qwen/Qwen3-8B")          # or ModelPricing(...) of your own
    model.set_cost_calculator(art.costs.build_cost_calculator(pricing))
    with model.metrics_builder("train").activate_context():
        await model.openai_client().chat.completions.create(...)     # adds costs/train/tinker_*

The table holds ART's hosted (Tinker) prices in dollars per million tokens, which is why the
keys a calculator returns are named `tinker_prefill` and `tinker_sample`, as in ART.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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
        raise ValueError(f"no pricing for model {model_name!r}: pass a ModelPricing of your own to "
                         f"build_cost_calculator, or add it to art.costs.MODEL_PRICING (known: {', '.join(MODEL_PRICING)})")
    return pricing


def tokens_to_cost(num_tokens: float, price_per_million: float) -> float:
    return float(num_tokens) * price_per_million / 1_000_000


def compute_sample_costs(*, prompt_tokens: int | None, completion_tokens: int | None, pricing: ModelPricing,
                         cost_context: str = "train") -> dict[str, float]:
    """The cost of one request's prompt and completion tokens, under `costs/<cost_context>/`."""
    if not cost_context or not cost_context.strip("/"):
        raise ValueError("cost_context must be a non-empty name such as 'train' or 'eval'")
    prefix = f"costs/{cost_context.strip('/')}"
    return {f"{prefix}/tinker_prefill": tokens_to_cost(prompt_tokens or 0, pricing.prefill),
            f"{prefix}/tinker_sample": tokens_to_cost(completion_tokens or 0, pricing.sample)}


def build_cost_calculator(pricing: ModelPricing) -> CostCalculator:
    """A calculator for `Model.set_cost_calculator`: `(prompt_tokens, completion_tokens,
    cost_context="train")` -> the request's costs by key."""

    def calculate(prompt_tokens: int | None, completion_tokens: int | None,
                  cost_context: str = "train") -> dict[str, float]:
        return compute_sample_costs(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                    pricing=pricing, cost_context=cost_context)

    return calculate


def compute_train_cost(train_tokens: float, pricing: ModelPricing) -> float:
    return tokens_to_cost(train_tokens, pricing.train)
