"""API costs: `art.metrics.track_api_cost`, `MetricsBuilder.add_response_cost` and its prices.

The provider APIs (OpenAI, Anthropic, OpenRouter) cannot be reached from a test, and their
bills are what is checked, so a small stand-in of each answers on loopback with the usage the
test sets; the official `openai` and `anthropic` clients call it and parse its answers, so
the costs are read from the same response objects a user's judge call returns.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from fastapi import FastAPI, Request

import art
from art.costs import MODEL_PRICING, compute_sample_costs, get_model_pricing
from art.metrics import MetricsBuilder, track_api_cost
from art.server.thread import ServerThread

ASK = [{"role": "user", "content": "Is the answer correct?"}]


class ProviderStandIn:
    """OpenAI's `/v1/chat/completions` and Anthropic's `/v1/messages`, answering with `usage`."""

    def __init__(self) -> None:
        self.usage: dict = {}
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "yes"}}],
                    "usage": self.usage}

        @app.post("/v1/messages")
        async def messages(request: Request):
            body = await request.json()
            return {"id": "m", "type": "message", "role": "assistant", "model": body["model"],
                    "content": [{"type": "text", "text": "yes"}], "stop_reason": "end_turn",
                    "stop_sequence": None, "usage": self.usage}

        self.app = app


@pytest.fixture(scope="module")
def provider():
    stand_in = ProviderStandIn()
    with ServerThread(stand_in.app) as server:
        stand_in.openai = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        stand_in.sync_openai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        stand_in.anthropic = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="x", max_retries=0)
        yield stand_in


def openai_usage(prompt: int, completion: int, cached: int = 0, **extra) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, **extra}


async def charged(builder: MetricsBuilder, call) -> dict[str, float]:
    """Run `call()` with `builder` active; what the builder then flushes."""
    token = builder.activate()
    try:
        await call()
    finally:
        token.var.reset(token)
    return await builder.flush()


# -- how a response is priced ---------------------------------------------------------------------


@pytest.mark.integration
async def test_explicit_prices_and_openai_cached_tokens(provider):
    @track_api_cost(source="llm_judge/correctness", provider="openai", model_name="openai/gpt-4.1",
                    prompt_price_per_million=2.0, completion_price_per_million=8.0,
                    cached_prompt_price_per_million=0.5)
    async def judge():
        return await provider.openai.chat.completions.create(model="gpt-4.1", messages=ASK)

    provider.usage = openai_usage(2_000, 100, cached=1_500)
    got = await charged(MetricsBuilder(cost_context="train"), judge)
    # 500 fresh prompt tokens at $2, 1500 cached at $0.5, 100 completion tokens at $8 (per million).
    assert got["costs/train/llm_judge/correctness"] == pytest.approx((500 * 2 + 1_500 * 0.5 + 100 * 8) / 1e6)
    assert got["costs/train"] == got["costs/all"] == got["costs/cum/train/llm_judge/correctness"]


@pytest.mark.integration
async def test_the_table_prices_a_model_by_its_name_not_the_snapshot_that_answered(provider):
    @track_api_cost(source="llm_judge/snapshot", provider="openai", model_name="openai/gpt-4.1")
    async def judge():
        return await provider.openai.chat.completions.create(model="gpt-4.1-2025-04-14", messages=ASK)

    provider.usage = openai_usage(1_000, 100, cached=800)
    got = await charged(MetricsBuilder(cost_context="train"), judge)
    assert got["costs/train/llm_judge/snapshot"] == pytest.approx((200 * 2.0 + 800 * 0.5 + 100 * 8.0) / 1e6)


@pytest.mark.integration
async def test_a_hosted_model_falls_back_to_the_tinker_table(provider):
    @track_api_cost(source="llm_judge/hosted", provider="openai", model_name="openai/gpt-oss-20b")
    async def judge():
        return await provider.openai.chat.completions.create(model="gpt-oss-20b", messages=ASK)

    provider.usage = openai_usage(1_000, 2_000)
    got = await charged(MetricsBuilder(cost_context="train"), judge)
    expected = compute_sample_costs(prompt_tokens=1_000, completion_tokens=2_000, cost_context="train",
                                    pricing=get_model_pricing("openai/gpt-oss-20b"))
    assert expected == {"costs/train/tinker_prefill": pytest.approx(0.00012),
                        "costs/train/tinker_sample": pytest.approx(0.0006)}
    assert got["costs/train/llm_judge/hosted"] == pytest.approx(sum(expected.values()))
    assert MODEL_PRICING["openai/gpt-oss-20b"].prefill == 0.12


@pytest.mark.integration
async def test_anthropic_registered_prices_with_cache_writes_and_reads(provider):
    builder = MetricsBuilder(cost_context="eval")
    builder.register_model_pricing("anthropic/claude-sonnet-4-6", prompt_per_million=3.0, completion_per_million=15.0,
                                   cache_creation_per_million=3.75, cache_read_per_million=0.30)

    @track_api_cost(source="llm_judge/anthropic_cache", provider="anthropic", model_name="anthropic/claude-sonnet-4-6")
    async def judge():
        return await provider.anthropic.messages.create(model="claude-sonnet-4-6", max_tokens=10, messages=ASK)

    provider.usage = {"input_tokens": 100, "output_tokens": 50, "cache_creation_input_tokens": 1_000,
                      "cache_read_input_tokens": 500}
    got = await charged(builder, judge)
    assert got["costs/eval/llm_judge/anthropic_cache"] == pytest.approx(
        (100 * 3.0 + 1_000 * 3.75 + 500 * 0.30 + 50 * 15.0) / 1e6)
    # Without cache prices, cache tokens cost what prompt tokens cost.
    builder.register_model_pricing("anthropic/test-judge", prompt_per_million=5.0, completion_per_million=7.0)

    @track_api_cost(source="llm_judge/faithfulness", provider="anthropic", model_name="anthropic/test-judge")
    async def plain():
        return await provider.anthropic.messages.create(model="test-judge", max_tokens=10, messages=ASK)

    provider.usage = {"input_tokens": 40, "output_tokens": 60, "cache_read_input_tokens": 10}
    got = await charged(builder, plain)
    assert got["costs/eval/llm_judge/faithfulness"] == pytest.approx((50 * 5.0 + 60 * 7.0) / 1e6)


@pytest.mark.integration
async def test_a_cost_the_provider_reports_is_taken_as_given(provider):
    @track_api_cost(source="llm_judge/openrouter", provider="openrouter", model_name="openrouter/openai/gpt-4.1-mini")
    async def judge():
        return await provider.openai.chat.completions.create(model="openai/gpt-4.1-mini", messages=ASK)

    provider.usage = openai_usage(100, 50, cost=1.68e-05)  # OpenRouter's usage.cost; no price table needed
    got = await charged(MetricsBuilder(cost_context="train"), judge)
    assert got["costs/train/llm_judge/openrouter"] == pytest.approx(1.68e-05)
    provider.usage = openai_usage(100, 50, cost={"total_cost": 0.25})
    got = await charged(MetricsBuilder(cost_context="train"), judge)
    assert got["costs/train/llm_judge/openrouter"] == pytest.approx(0.25)


@pytest.mark.integration
async def test_a_registered_extractor_comes_before_token_prices(provider):
    builder = MetricsBuilder(cost_context="train")
    builder.register_cost_extractor("OpenAI", lambda response: response.usage.completion_tokens * 0.01)

    @track_api_cost(source="llm_judge/custom", provider="openai", model_name="openai/gpt-4.1",
                    prompt_price_per_million=1.0, completion_price_per_million=2.0)
    async def judge():
        return await provider.openai.chat.completions.create(model="gpt-4.1", messages=ASK)

    provider.usage = openai_usage(1, 75)
    got = await charged(builder, judge)
    assert got["costs/train/llm_judge/custom"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="callable"):
        builder.register_cost_extractor("openai", 0.75)


@pytest.mark.integration
async def test_an_unpriced_model_fails_fast_naming_it(provider):
    @track_api_cost(source="llm_judge/missing", provider="openai", model_name="openai/missing-pricing-model")
    async def judge():
        return await provider.openai.chat.completions.create(model="missing-pricing-model", messages=ASK)

    provider.usage = openai_usage(10, 20)
    with pytest.raises(ValueError, match="No pricing configured for model 'openai/missing-pricing-model'"):
        await charged(MetricsBuilder(cost_context="train"), judge)
    # Prices given in full price a model no table knows.
    priced = track_api_cost(source="llm_judge/missing", provider="openai", model_name="openai/missing-pricing-model",
                            prompt_price_per_million=1.0, completion_price_per_million=1.0)(judge.__wrapped__)
    got = await charged(MetricsBuilder(cost_context="train"), priced)
    assert got["costs/train/llm_judge/missing"] == pytest.approx(30 / 1e6)
    # A provider whose usage is not read here needs its cost reported, or an extractor.
    other = track_api_cost(source="x", provider="mistral", model_name="openai/gpt-4.1")(judge.__wrapped__)
    with pytest.raises(ValueError, match="No cost extractor registered for provider 'mistral'"):
        await charged(MetricsBuilder(cost_context="train"), other)


# -- the decorator --------------------------------------------------------------------------------


@pytest.mark.integration
async def test_without_an_active_builder_nothing_is_charged(provider):
    @track_api_cost(source="llm_judge/no_context", provider="openai", model_name="openai/gpt-4.1")
    async def judge():
        return await provider.openai.chat.completions.create(model="gpt-4.1", messages=ASK)

    provider.usage = openai_usage(10, 20)
    builder = MetricsBuilder(cost_context="train")
    response = await judge()
    assert response.choices[0].message.content == "yes" and await builder.flush() == {}


@pytest.mark.integration
async def test_a_sync_function_and_a_response_inside_its_result(provider):
    @track_api_cost(source="tool_model", provider="openai", model_name="openai/gpt-4.1",
                    response_getter=lambda result: result[1])
    def summarize(text: str):
        response = provider.sync_openai.chat.completions.create(model="gpt-4.1", messages=[
            {"role": "user", "content": text}])
        return response.choices[0].message.content, response

    provider.usage = openai_usage(1_000, 0)
    builder = MetricsBuilder(cost_context="train")
    with builder.activate_context():
        text, _ = summarize("hello")
    assert text == "yes" and summarize.__name__ == "summarize"
    assert (await builder.flush())["costs/train/tool_model"] == pytest.approx(1_000 * 2.0 / 1e6)


@pytest.mark.parametrize("kwargs,field", [
    ({"source": "/", "provider": "openai", "model_name": "m"}, "source"),
    ({"source": "judge", "provider": " ", "model_name": "m"}, "provider"),
    ({"source": "judge", "provider": "openai", "model_name": ""}, "model_name"),
])
def test_the_decorator_refuses_empty_names(kwargs, field):
    with pytest.raises(ValueError, match=f"{field} must be a non-empty string"):
        track_api_cost(**kwargs)


def test_registered_prices_must_be_numbers_at_least_zero():
    builder = MetricsBuilder()
    with pytest.raises(ValueError, match="cache_read_per_million must be a number >= 0"):
        builder.register_model_pricing("a/b", prompt_per_million=1.0, completion_per_million=1.0,
                                       cache_read_per_million=-1.0)
    with pytest.raises(ValueError, match="model_name must be non-empty"):
        builder.register_model_pricing(" ", prompt_per_million=1.0, completion_per_million=1.0)


@pytest.mark.integration
async def test_another_context_shares_prices_but_not_pending_costs(provider):
    train = MetricsBuilder(cost_context="train")
    train.register_model_pricing("anthropic/test-judge", prompt_per_million=1.5, completion_per_million=2.5)
    evaluation = train.for_cost_context("eval")

    @track_api_cost(source="llm_judge/provider_resolution", provider="anthropic", model_name="anthropic/test-judge")
    async def judge():
        return await provider.anthropic.messages.create(model="test-judge", max_tokens=10, messages=ASK)

    provider.usage = {"input_tokens": 400, "output_tokens": 600}
    got = await charged(evaluation, judge)
    assert got["costs/eval/llm_judge/provider_resolution"] == pytest.approx(0.0021)
    assert await train.flush() == {}


# -- through a model's log ------------------------------------------------------------------------


def history(tmp_path, name: str) -> list[dict]:
    path = tmp_path / name / "models" / name / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.integration
async def test_model_log_writes_train_and_eval_costs_each_to_its_own_row(provider, tmp_path):
    model = art.Model(name="costs", project="costs", base_path=str(tmp_path), report_metrics=[])

    @track_api_cost(source="llm_judge/correctness", provider="openai", model_name="openai/gpt-4.1",
                    prompt_price_per_million=1.0, completion_price_per_million=2.0)
    async def train_judge():
        provider.usage = openai_usage(100, 50)
        return await provider.openai.chat.completions.create(model="gpt-4.1", messages=ASK)

    @track_api_cost(source="llm_judge/factuality", provider="anthropic", model_name="anthropic/claude-sonnet-4-6",
                    prompt_price_per_million=3.0, completion_price_per_million=4.0)
    async def eval_judge():
        provider.usage = {"input_tokens": 40, "output_tokens": 10}
        return await provider.anthropic.messages.create(model="claude-sonnet-4-6", max_tokens=10, messages=ASK)

    for context, call in (("train", train_judge), ("eval", eval_judge)):
        token = model.activate_metrics_context(context)
        try:
            await call()
        finally:
            token.var.reset(token)
    # Both are pending; each split's row takes only its own ("val" writes the "eval" context).
    await model.log(trajectories=None, split="val", step=1, metrics={})
    await model.log(trajectories=None, split="train", step=1, metrics={})
    val_row, train_row = history(tmp_path, "costs")
    assert val_row["costs/eval/llm_judge/factuality"] == pytest.approx(0.00016)
    assert "costs/train/llm_judge/correctness" not in val_row and val_row["costs/cum/all"] == pytest.approx(0.00016)
    assert train_row["costs/train/llm_judge/correctness"] == pytest.approx(0.0002)
    assert "costs/eval/llm_judge/factuality" not in train_row
    assert train_row["costs/cum/all"] == pytest.approx(0.00036)
