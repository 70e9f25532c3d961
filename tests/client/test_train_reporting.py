"""What a first training run tells its user: the learning rate in effect on every train row
(ART's default 5e-6 unless the config says otherwise, even on a step with nothing to train),
the trainer's bar named by the step history files the row under, and the resolved training
config with its proper keys, printed and kept in model.json."""

from __future__ import annotations

import json

import art
from art.storage.history import rows_for_split
from tests.support.fakes import groups_of_choices


def equal_rewards(groups: list[art.TrajectoryGroup]) -> list[art.TrajectoryGroup]:
    for group in groups:
        for trajectory in group.trajectories:
            trajectory.reward = 1.0
    return groups


async def test_learning_rate_on_every_train_row_and_the_bar_names_the_rows_step(tiny_model_path, tmp_path, capfd):
    async with art.LocalBackend(path=str(tmp_path)) as backend:
        model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path))
        await model.register(backend)
        capfd.readouterr()
        await model.train(equal_rewards(groups_of_choices(seed=1)))  # ART's default: nothing to train
        await model.train(groups_of_choices(seed=2), config=art.TrainConfig(learning_rate=1e-3))
        out, err = capfd.readouterr()
    run = tmp_path / "p" / "models" / "m"
    rows = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [(row["step"], row["train/learning_rate"]) for row in rows_for_split(rows, "train")] == [
        (0, 5e-6), (1, 1e-3)]
    assert rows[0].get("train/nothing_to_train") == 1.0
    # The second call trains from step 1 and history files its row under step 1: so does the bar.
    assert "train step 1" in err and "train step 2" not in err, err[-2000:]

    printed = [line for line in out.splitlines() if "training config:" in line]
    assert printed and all('"epsilon": 1.0' in line and '"epsilon_high": 4.0' in line for line in printed), printed
    options = json.loads((run / "model.json").read_text())["train_options"]
    assert options["learning_rate"] == 1e-3 and (options["epsilon"], options["epsilon_high"]) == (1.0, 4.0)
    assert not [key for key in options if "," in key or " " in key], options
