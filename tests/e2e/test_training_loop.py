"""The whole loop on a tiny random model: serve, roll out, train, checkpoint, resume."""

import json
import logging

import pytest
import torch

import art
from tests.support.fakes import greedy_logprobs, one_step, rollout

pytestmark = pytest.mark.integration


async def test_train_two_steps_then_resume(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="tiny", project="loop", base_model=str(tiny_model_path))
    await model.register(backend)
    assert await model.get_step() == 0
    run = tmp_path / "loop" / "models" / "tiny"
    assert (run / "checkpoints" / "0000" / "adapter_model.safetensors").exists()
    before = await greedy_logprobs(model, "tiny")

    for step in range(await model.get_step(), 2):
        await one_step(model, step)
    assert await model.get_step() == 2
    after = await greedy_logprobs(model, "tiny")
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-4, "training did not change served logprobs"
    # Older checkpoints stay servable by name, and the base model by its id.
    assert await greedy_logprobs(model, "tiny@0") == pytest.approx(before, abs=1e-4)
    assert await greedy_logprobs(model, str(tiny_model_path)) == pytest.approx(before, abs=1e-4)
    assert await greedy_logprobs(model, "tiny@2") == pytest.approx(after, abs=1e-4)

    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == [0, 1]
    assert all("train/reward" in row and "train/loss" in row for row in history)
    logged = (run / "trajectories" / "train" / "0001.jsonl").read_text().splitlines()
    assert len(logged) == 8 and "token_ids" in json.dumps(json.loads(logged[0]))
    service = backend.service.loaded(("loop", "tiny"))
    optimizer_state = {k: v["exp_avg"].clone() for k, v in service.trainer.optimizer.state_dict()["state"].items()}
    await backend.close()

    # A new process (new backend, new model object) resumes at step 2 with adapter and optimizer.
    backend2 = art.LocalBackend(path=str(tmp_path))
    model2 = art.TrainableModel(name="tiny", project="loop", base_model=str(tiny_model_path))
    await model2.register(backend2)
    assert await model2.get_step() == 2
    assert await greedy_logprobs(model2, "tiny") == pytest.approx(after, abs=1e-4)
    restored = backend2.service.loaded(("loop", "tiny")).trainer.optimizer.state_dict()["state"]
    assert optimizer_state.keys() == restored.keys()
    assert all(torch.equal(optimizer_state[k], restored[k]["exp_avg"]) for k in optimizer_state)
    await one_step(model2, 2)
    assert await model2.get_step() == 3

    deleted = await model2.delete_checkpoints(best_checkpoint_metric="train/reward")
    best = max((row for row in history), key=lambda row: row["train/reward"])["step"]
    remaining = sorted(int(p.name) for p in (run / "checkpoints").iterdir())
    assert remaining == sorted({3, best}) and sorted(deleted + remaining) == [0, 1, 2, 3]
    await backend2.close()


async def test_step_with_nothing_to_train_says_why_and_advances(tiny_model_path, tmp_path, caplog, capsys):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="flat", project="loop", base_model=str(tiny_model_path))
    await model.register(backend)
    client = model.openai_client()
    completion = await client.chat.completions.create(
        model="flat", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2)
    group = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[choice], reward=0.5) for choice in completion.choices
    ])
    with caplog.at_level(logging.WARNING):
        result = await backend.train(model, [group], learning_rate=1e-3)
    assert result.step == 1 and await model.get_step() == 1
    assert result.metrics["nothing_to_train"] == 1.0
    assert result.metrics["skipped/group_rewards_all_equal"] == 1.0
    assert "rewards are all equal" in caplog.text
    # What to do about it, in the same message: a cold start needs a way to get differing rewards.
    (said,) = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
    for remedy in ("demonstration", "plain messages", "graded", "response_format", "train_sft"):
        assert remedy in said, remedy
    printed = capsys.readouterr().out
    assert "training config" in printed and '"learning_rate": 0.001' in printed and '"ppo": false' in printed  # ART's default objective, CISPO
    saved = json.loads((tmp_path / "loop" / "models" / "flat" / "model.json").read_text())
    assert saved["train_options"]["learning_rate"] == 1e-3 and saved["train_options"]["max_grad_norm"] == 0.1
    with pytest.raises(art.ArtValueError, match="learning_rate"):
        await backend.train(model, [group], learning_rate=-1.0)
    assert await model.get_step() == 1
    await backend.close()


async def test_prompted_baseline_keeps_its_endpoint_and_logs_beside_the_runs(tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    baseline = art.Model(name="gpt-baseline", project="loop", inference_base_url="http://127.0.0.1:9/v1",
                         inference_model_name="gpt-4o-mini")
    await baseline.register(backend)
    assert baseline.openai_client().base_url.host == "127.0.0.1"
    assert baseline.get_inference_name() == "gpt-4o-mini"
    group = art.TrajectoryGroup([art.Trajectory(reward=r, metrics={"turns": 2}) for r in (0.0, 1.0)])
    await baseline.log([group], split="val")
    (row,) = [json.loads(line) for line in (tmp_path / "loop" / "models" / "gpt-baseline" / "history.jsonl").open()]
    assert row["step"] == 0 and row["val/reward"] == 0.5 and row["val/turns"] == 2.0
    assert row["val/reward_std_dev"] == 0.5
    await backend.close()


async def test_requests_during_a_training_step_all_succeed_and_say_their_step(tiny_model_path, tmp_path):
    import asyncio

    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="swap", project="loop", base_model=str(tiny_model_path))
    await model.register(backend)
    client = model.openai_client()
    first = await client.chat.completions.create(
        model="swap", messages=[{"role": "user", "content": "go"}], max_tokens=3, n=4, seed=1)
    group = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[choice], reward=float(i)) for i, choice in enumerate(first.choices)])

    async def ask(i):
        await asyncio.sleep(0.01 * i)
        response = await client.chat.completions.create(
            model="swap", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=24,
            extra_body={"ignore_eos": True})
        return response.model_extra["step"], response.choices[0].token_ids

    requests = [asyncio.ensure_future(ask(i)) for i in range(24)]
    await asyncio.sleep(0.05)
    result = await backend.train(model, [group], learning_rate=1e-2)
    after = await ask(0)
    answers = await asyncio.gather(*requests)
    assert result.step == 1 and after[0] == 1
    assert all(len(ids) == 24 for _, ids in answers)
    steps = [step for step, _ in answers]
    assert set(steps) <= {0, 1} and 0 in steps  # requests running when training began finished on step 0
    import httpx

    health = httpx.get(model.inference_base_url.removesuffix("/v1") + "/health").json()
    stats = health["engines"]["loop/swap"]
    assert stats["step"] == 1 and stats["engine/queue_depth"] == 0 and stats["engine/decode_steps"] > 0
    await backend.close()


async def test_dynamic_sampling_trains_only_groups_with_signal_and_counts_every_rollout(tiny_model_path, tmp_path):
    """Groups alternate between equal rewards and mixed ones: dynamic sampling drops the equal
    ones, draws more, trains on the mixed ones only, and the step's metrics count every rollout."""
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="tiny", project="dynamic", base_model=str(tiny_model_path))
    await model.register(backend)

    async def scored(seed: int, reward: float) -> art.Trajectory:
        trajectory = await rollout(model, seed)
        trajectory.reward = reward
        return trajectory

    def groups():
        for k in range(100):  # read lazily: only as many as needed are drawn
            rewards = [1.0] * 4 if k % 2 == 0 else [0.0, 1.0, 0.0, 1.0]
            yield art.TrajectoryGroup(scored(10 * k + i, r) for i, r in enumerate(rewards))

    gathered = await art.gather_trajectory_groups(groups(), pbar_desc=None, min_groups_with_signal=2)
    assert len(gathered) == 2 and all(len({t.reward for t in g.trajectories}) == 2 for g in gathered)
    assert (gathered.stats.groups_drawn, gathered.stats.groups_without_signal, gathered.stats.rollouts) == (4, 2, 16)
    await model.train(gathered, config=art.TrainConfig(learning_rate=1e-2))
    await backend.close()
    (row,) = [json.loads(line) for line in (tmp_path / "dynamic" / "models" / "tiny" / "history.jsonl").open()]
    assert row["train/groups_trained"] == 2 and "train/skipped/group_rewards_all_equal" not in row
    assert row["train/rollouts"] == 16 and row["train/rollouts_per_trained_group"] == 8
    assert row["train/groups_without_signal"] == 2
    assert row["train/reward_all_rollouts"] == pytest.approx((1.0 * 8 + 0.5 * 8) / 16)
    assert row["train/reward"] == pytest.approx(0.5)  # the kept groups' own mean
