"""`history.jsonl` rows hold ART's keys only (ART's readers reject any other), and the split each
row was logged for is read back from its metric names."""

from __future__ import annotations

import json

import pytest

import art
from art.errors import ArtValueError
from art.storage.history import row_split, rows_for_split
from art.storage.layout import ModelDir
from art.storage.run_log import write_log

ART_ROW_KEYS = {"step", "recorded_at", "training_step"}


def rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "p" / "models" / "m" / "history.jsonl").read_text().splitlines()]


async def test_logged_rows_carry_arts_keys_and_their_split_in_the_names(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=[])
    group = art.TrajectoryGroup([art.Trajectory(reward=r, metrics={"custom": r}) for r in (0.2, 0.8)])
    await model.log([group], split="val", step=0)
    await model.log([group], split="train", step=1, metrics={"loss/train": 0.3})
    await model.log([group], split="discarded", step=1)
    await model.log([group], split="test", step=2)

    written = rows(tmp_path)
    assert [row["step"] for row in written] == [0, 1, 1, 2]
    for row in written:
        assert "split" not in row and ART_ROW_KEYS <= row.keys()
        assert all("/" in key for key in row.keys() - ART_ROW_KEYS), row  # every metric is namespaced
    assert [row_split(row) for row in written] == ["val", "train", "discarded", "test"]
    assert [row["step"] for row in rows_for_split(written, "train")] == [1]
    assert written[0]["val/custom"] == pytest.approx(0.5)


def test_the_split_of_rows_ours_wrote_before_and_rows_that_name_none():
    assert row_split({"step": 3, "split": "val", "reward": 1.0}) == "val"  # a row from before the change
    assert row_split({"step": 1, "train/reward": 0.5, "queue/groups_depth": 2.0, "vllm/kv_cache_usage_perc": 0.1,
                      "offpolicy/steps_off_policy_max": 1.0, "discarded/step/stale_groups": 0.0}) == "train"
    assert row_split({"step": 2, "checkpoint/saved": 1.0, "checkpoint/created_at_unix": 1.7e9}) is None
    assert row_split({"step": 2, "time/step_eval_s": 3.0}) is None
    assert row_split({"step": 2, "val/reward": 1.0, "test/reward": 0.0}) is None  # two splits: ambiguous


def test_a_metric_may_not_take_a_row_key_or_the_old_split_name(tmp_path):
    directory = ModelDir(tmp_path, "p", "m")
    for name in ("split", "step", "recorded_at", "training_step"):
        with pytest.raises(ArtValueError, match="would overwrite") as bad:
            write_log(directory, split="val", step=0, metrics={name: 1.0})
        assert bad.value.field == f"metrics.{name}"
    assert not directory.history.exists()
