"""History rows follow ART's metric taxonomy: routing, `data/` counts, costs and their roll-ups,
running totals that survive a new `Model`, the metrics builder, W&B's `report_metrics` and
config, and costs of completions made through `model.openai_client()`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import art
from art.costs import ModelPricing, build_cost_calculator, get_model_pricing
from art.metrics_taxonomy import route_key
from art.observability import wandb_sink
from art.serve import create_serve_app
from art.service.local import LocalService
from art.storage.history import row_split, rows_for_split
from tests.support.servers import gather


def rows(base: Path, project: str = "p", name: str = "m") -> list[dict]:
    path = base / project / "models" / name / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def new_model(base: Path, **kwargs) -> art.Model:
    return art.Model(name="m", project="p", base_path=str(base), report_metrics=[], **kwargs)


def test_known_sections_keep_their_names_and_others_get_the_split():
    assert route_key("reward/mean", "train") == "reward/mean"
    assert route_key("costs/train/prefill", "val") == "costs/train/prefill"
    assert route_key("custom", "train") == "train/custom"
    assert route_key("checkpoint/foo", "train") == "train/checkpoint/foo"
    assert route_key("rewardish/value", "train") == "train/rewardish/value"
    assert route_key("train/loss", "train") == "train/loss"  # already the split's


async def test_a_train_row_routes_counts_and_ids(tmp_path):
    model = new_model(tmp_path)
    groups = [
        art.TrajectoryGroup([art.Trajectory(reward=0.8, metrics={"custom_score": 1.0, "reward/prefixed": 2.0}),
                             art.Trajectory(reward=0.2)], metadata={"scenario_id": "s1"}),
        art.TrajectoryGroup([art.Trajectory(reward=0.5)], exceptions=[ValueError("boom")],
                            metadata={"scenario_id": "s2"}),
    ]
    await model.log(groups, split="train", step=7, metrics={"checkpoint/foo": 1.5, "loss/train": 0.3})
    [row] = rows(tmp_path)
    assert row["training_step"] == 7 and row["step"] == 7 and row_split(row) == "train" and "split" not in row
    assert row["train/reward"] == pytest.approx(0.5) and row["train/custom_score"] == 1.0
    assert row["reward/prefixed"] == 2.0 and row["loss/train"] == 0.3 and row["train/checkpoint/foo"] == 1.5
    assert row["train/exception_rate"] == pytest.approx(0.25)
    assert (row["data/step_num_scenarios"], row["data/step_num_trajectories"], row["data/step_num_groups_submitted"],
            row["data/step_num_groups_trainable"]) == (2.0, 4.0, 2.0, 1.0)
    assert row["data/cum/num_unique_scenarios"] == 2.0 and row["data/cum/num_trajectories"] == 4.0
    assert not {"train/num_groups", "train/num_trajectories"} & row.keys()
    assert row["time/wall_clock_sec"] >= 0 and row["time/step_wall_s"] >= 0


async def test_other_splits_are_counted_under_their_own_prefix(tmp_path):
    await new_model(tmp_path).log([art.TrajectoryGroup([art.Trajectory(reward=1.0, metrics={"x": 2})])], split="val")
    [row] = rows(tmp_path)
    assert row["val/num_trajectories"] == 1.0 and row["val/x"] == 2.0
    assert not [k for k in row if k.startswith("data/")]


async def test_costs_roll_up_and_their_totals_survive_a_new_model(tmp_path):
    await new_model(tmp_path).log(split="train", step=1, metrics={"costs/train/prefill": 0.2,
                                                                  "costs/train/sample": 0.3})
    await new_model(tmp_path).log(split="train", step=2, metrics={"costs/train/prefill": 0.1, "costs/eval/judge": 1.0})
    first, second = rows(tmp_path)
    assert first["costs/train"] == pytest.approx(0.5) and first["costs/all"] == pytest.approx(0.5)
    assert first["costs/cum/all"] == pytest.approx(0.5)
    assert second["costs/train"] == pytest.approx(0.1) and second["costs/all"] == pytest.approx(1.1)
    assert second["costs/cum/train/prefill"] == pytest.approx(0.3)
    assert second["costs/cum/train"] == pytest.approx(0.6) and second["costs/cum/all"] == pytest.approx(1.6)
    assert second["costs/cum/eval/judge"] == pytest.approx(1.0)


async def test_step_times_and_counts_get_totals_and_throughput(tmp_path):
    model = new_model(tmp_path)
    model.metrics_builder().add_data(scenario_ids=["a"])
    await model.log(split="train", step=1, metrics={"time/step_trainer_s": 2.0, "data/step_trainer_tokens": 20.0,
                                                    "time/step_actor_s": 1.5, "data/step_actor_tokens": 30})
    await model.log(split="train", step=2, metrics={"time/step_trainer_s": 3.0, "data/step_trainer_tokens": 40.0})
    await model.log(split="train", step=3, metrics={"loss/train": 1.0})
    first, second, third = rows(tmp_path)
    assert first["time/cum/actor_s"] == 1.5 and first["data/cum/actor_tokens"] == 30
    assert first["throughput/avg_trainer_tok_per_s"] == pytest.approx(10.0)
    assert first["throughput/avg_actor_tok_per_s"] == pytest.approx(20.0)
    assert second["throughput/avg_trainer_tok_per_s"] == pytest.approx(60.0 / 5.0)
    assert "throughput/avg_actor_tok_per_s" not in second
    assert first["data/cum/num_unique_scenarios"] == 1.0
    assert not {"throughput/avg_trainer_tok_per_s", "data/cum/num_unique_scenarios"} & third.keys()
    # A new Model object continues the run's totals, scenario ids included.
    again = new_model(tmp_path)
    again.metrics_builder().add_data(scenario_ids=["a", "b"])
    await again.log(split="train", step=4, metrics={"time/step_trainer_s": 5.0})
    assert rows(tmp_path)[-1]["time/cum/trainer_s"] == 10.0
    assert rows(tmp_path)[-1]["data/cum/num_unique_scenarios"] == 2.0


async def test_the_builder_feeds_only_the_next_row_of_its_split(tmp_path):
    model = new_model(tmp_path)
    train, val = model.metrics_builder("train"), model.metrics_builder("val")
    train.add_cost("train/judge", 0.25)
    train.add_cost("train/judge", 0.25)
    with train.measure("time/step_actor_s"):
        pass
    val.add_metric("data/step_eval_tokens", 5)
    await model.log(split="val", step=0)
    await model.log(split="train", step=0)
    await model.log(split="train", step=1)
    val_row, train_row, later = rows(tmp_path)
    assert val_row["data/step_eval_tokens"] == 5 and "costs/train/judge" not in val_row
    assert train_row["costs/train/judge"] == 0.5 and train_row["time/step_actor_s"] >= 0
    assert "costs/train/judge" not in later


async def test_the_builder_refuses_keys_it_cannot_log():
    builder = art.Model(name="m", project="p").metrics_builder()
    with pytest.raises(ValueError, match="section"):
        builder.add_metric("loose", 1.0)
    with pytest.raises(ValueError, match="cumulative"):
        builder.add_metric("time/cum/actor_s", 1.0)
    builder.add_cost("train/judge/call", 1.0)
    with pytest.raises(ValueError, match="nests"):
        builder.add_cost("train/judge", 1.0)
    with pytest.raises(LookupError):
        art.metrics.MetricsBuilder.get_active()
    with builder.activate_context():
        assert art.metrics.MetricsBuilder.get_active() is builder
    flushed = await builder.flush()
    step = {"costs/train/judge/call": 1.0, "costs/train/judge": 1.0, "costs/train": 1.0, "costs/all": 1.0}
    # As ART's, a flush carries the running totals of this process with the step's values.
    assert flushed == {**step, **{k.replace("costs/", "costs/cum/", 1): v for k, v in step.items()}}
    assert await builder.flush() == {}


def test_pricing_and_the_calculator():
    pricing = get_model_pricing("openai/gpt-oss-20b")
    assert pricing == ModelPricing(prefill=0.12, sample=0.30, train=0.36)
    assert get_model_pricing("nobody/unknown") is None
    with pytest.raises(ValueError, match="nobody/unknown"):
        get_model_pricing("nobody/unknown", strict=True)
    model = art.Model(name="m", project="p")
    model.set_cost_calculator(build_cost_calculator(pricing))
    costs = model.cost_calculator(1_000, 2_000, "train")
    assert costs == {"costs/train/tinker_prefill": pytest.approx(0.00012),
                     "costs/train/tinker_sample": pytest.approx(0.0006)}


async def test_completions_inside_a_builder_add_their_cost(served_model):
    model = served_model
    pricing = ModelPricing(prefill=1000.0, sample=3000.0, train=0.0)
    model.set_cost_calculator(build_cost_calculator(pricing))
    client = model.openai_client()
    ask = {"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    await client.chat.completions.create(**ask)  # outside a builder: not priced
    builder = model.metrics_builder("eval")
    with builder.activate_context():
        one = await client.chat.completions.create(**ask)
        three = await client.chat.completions.create(**ask, n=3)
        stream = await client.chat.completions.create(**ask, stream=True)
        async for _ in stream:
            pass
        answer = await client.responses.create(model=model.name, input="hi", max_output_tokens=3)
    got = await builder.flush()
    prompt = one.usage.prompt_tokens + 3 * three.usage.prompt_tokens + answer.usage.input_tokens
    completion = one.usage.completion_tokens + three.usage.completion_tokens + answer.usage.output_tokens
    assert got["costs/eval/tinker_prefill"] == pytest.approx(prompt * 1000.0 / 1e6)
    assert got["costs/eval/tinker_sample"] == pytest.approx(completion * 3000.0 / 1e6)
    assert got["costs/eval"] == pytest.approx((prompt * 1000.0 + completion * 3000.0) / 1e6)
    model.set_cost_calculator(None)


@pytest.fixture
async def served_model(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="priced", project="p", base_model=str(tiny_model_path), report_metrics=[])
    await model.register(backend)
    yield model
    await backend.close()


async def test_gpu_cost_follows_each_train_rows_wall_time(tmp_path):
    with pytest.raises(art.ArtValueError) as info:
        art.LocalBackend(path=str(tmp_path), gpu_cost_per_hour_usd=-1.0)
    assert info.value.field == "gpu_cost_per_hour_usd"
    backend = art.LocalBackend(path=str(tmp_path), gpu_cost_per_hour_usd=3.0)
    model = art.Model(name="m", project="p", report_metrics=[], inference_base_url="http://127.0.0.1:9/v1")
    await model.register(backend)
    await model.log(split="train", step=1, metrics={"loss/train": 1.0})
    await model.log(split="train", step=2, metrics={"loss/train": 0.5})
    await model.log(split="val", step=2, metrics={"x": 1.0})
    first, second, val = rows(tmp_path)
    for row in (first, second):
        assert row["costs/gpu"] == pytest.approx(row["time/step_wall_s"] * 3.0 / 3600)
        assert row["costs/all"] == pytest.approx(row["costs/gpu"])
    assert second["costs/cum/gpu"] == pytest.approx(first["costs/gpu"] + second["costs/gpu"])
    assert "costs/gpu" not in val and "time/step_wall_s" not in val
    plain = art.Model(name="n", project="p", report_metrics=[], inference_base_url="http://127.0.0.1:9/v1")
    await plain.register(art.LocalBackend(path=str(tmp_path)))
    await plain.log(split="train", step=1, metrics={"loss/train": 1.0})
    [row] = rows(tmp_path, name="n")
    assert row["time/step_wall_s"] >= 0 and "costs/gpu" not in row and "costs/all" not in row


async def test_a_remote_client_gets_the_same_totals(tmp_path):
    app = create_serve_app(LocalService(str(tmp_path)))
    async with art.RemoteBackend("http://testserver", transport=httpx.ASGITransport(app)) as backend:
        for attempt in range(2):  # a second client object continues the totals the server keeps
            model = art.Model(name="m", project="p", report_metrics=[], inference_base_url="http://127.0.0.1:9/v1")
            await model.register(backend)
            groups = [art.TrajectoryGroup([art.Trajectory(reward=r) for r in (0.0, 1.0)],
                                          metadata={"scenario_id": f"s{attempt}"})]
            await model.log(groups, split="train", step=attempt, metrics={"costs/train/sample": 0.5})
    first, second = rows(tmp_path)
    assert second["costs/cum/all"] == pytest.approx(1.0)
    assert second["data/cum/num_unique_scenarios"] == 2.0 and second["data/cum/num_groups_trainable"] == 2.0


async def test_report_metrics_and_wandb_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    group = art.TrajectoryGroup([art.Trajectory(reward=1.0)])
    silent = art.Model(name="silent", project="wb", base_path=str(tmp_path), report_metrics=[])
    await silent.log([group], split="val")
    assert ("wb", "silent") not in wandb_sink._runs

    model = art.Model(name="loud", project="wb", base_path=str(tmp_path), report_metrics=["wandb"])
    model.update_wandb_config({"experiment": {"learning_rate": 1e-5}})
    with pytest.raises(ValueError, match="Conflicting value for 'experiment.learning_rate'"):
        model.update_wandb_config({"experiment": {"learning_rate": 2e-5}})
    try:
        await model.log(split="train", step=1, metrics={"costs/train/sample": 0.5})
        run = wandb_sink._runs[("wb", "loud")]
        assert run.config["experiment"] == {"learning_rate": 1e-5}
        assert run.summary["costs/cum/all"] == 0.5 and run.summary["training_step"] == 1
        model.update_wandb_config({"experiment": {"batch_size": 8}, "dataset": {"split": "train"}})
        assert run.config["experiment"] == {"learning_rate": 1e-5, "batch_size": 8}
        assert run.config["dataset"] == {"split": "train"}
    finally:
        wandb_sink.finish_wandb()


async def test_a_train_step_logs_trainer_time_tokens_and_throughput(served_model, tmp_path):
    model = served_model
    await model.train(await gather(model, 0), config=art.TrainConfig(learning_rate=1e-3))
    [row] = rows_for_split(rows(tmp_path, name="priced"), "train")
    assert row["data/step_num_gradient_steps"] == row["train/optimizer_steps"] >= 1
    assert row["time/step_trainer_s"] > 0 and row["data/step_trainer_tokens"] == row["train/trained_tokens"] > 0
    assert row["throughput/avg_trainer_tok_per_s"] == pytest.approx(
        row["data/cum/trainer_tokens"] / row["time/cum/trainer_s"])
    assert row["training_step"] == 0 and row["train/loss"] == row["train/loss"]  # a number, not NaN
