"""The dashboard over a run folder written by OpenPipe ART, served on a loopback socket: its
steps as ART's Parquet or ART's older JSONL (a group per line), its history rows without a
`split` key and with ART's ISO `recorded_at`."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import httpx
import pytest

import art
from art.dashboard.app import create_dashboard_app
from art.server.thread import ServerThread
from art.utils.trajectory_logging import write_trajectory_groups_parquet
from tests.support.fakes import make_choice

NESTED = {"scenario": {"id": 3, "tags": ["x"]}}


def art_folder(root: Path) -> Path:
    """An ART run folder: train step 1 only as Parquet, val step 0 as ART's old JSONL."""
    run = root / "proj" / "models" / "agent"
    for split in ("train", "val"):
        (run / "trajectories" / split).mkdir(parents=True)
    groups = [art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[{"role": "user", "content": "Pick."}, make_choice([5, 6, 7], [8, 9])],
                       reward=reward, metadata=NESTED) for reward in (0.0, 1.0)],
        exceptions=[ValueError("a rollout failed")])]
    write_trajectory_groups_parquet(groups, run / "trajectories" / "train" / "0001.parquet")
    val_group = {"trajectories": [{"reward": 0.5, "metrics": {}, "metadata": {}, "logs": [], "tools": None,
                                   "messages_and_choices": [{"role": "user", "content": "Eval?"},
                                                            {"role": "assistant", "content": "Yes."}]}]}
    (run / "trajectories" / "val" / "0000.jsonl").write_text("\n".join([json.dumps(val_group)] * 2))  # ART's ending
    recorded = datetime(2026, 5, 1, 12, 0, 0)
    rows = [{"step": 0, "val/reward": 0.5, "recorded_at": recorded.isoformat(), "training_step": 0},
            {"step": 1, "train/reward": 0.5, "data/step_num_groups_trainable": 1.0,
             "recorded_at": recorded.isoformat(), "training_step": 1}]
    (run / "history.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


@pytest.fixture
def dashboard(tmp_path):
    art_folder(tmp_path)
    with ServerThread(create_dashboard_app(tmp_path)) as server:
        yield f"{server.base_url}/dashboard/api/runs/proj/agent"


def test_an_art_folders_steps_list_and_open(dashboard):
    assert httpx.get(f"{dashboard}/steps").json() == {"train": [1], "val": [0]}

    train = httpx.get(f"{dashboard}/steps/train/1").json()
    (group,) = train["groups"]
    assert [t["reward"] for t in group["trajectories"]] == [0.0, 1.0]
    assert [e["message"] for e in group["exceptions"]] == ["a rollout failed"]
    first = group["trajectories"][0]
    assert first["metadata"] == {"scenario": '{"id":3,"tags":["x"]}'}  # nested values shown as JSON text
    assert first["messages"][1]["choice"] and first["messages"][1]["trained"]

    val = httpx.get(f"{dashboard}/steps/val/0").json()
    assert [len(g["trajectories"]) for g in val["groups"]] == [1, 1]  # the last line has no newline and counts
    assert val["groups"][0]["trajectories"][0]["messages"][1]["content"] == "Yes."


def test_an_art_parquet_steps_tokens_come_from_its_trajectory_json(dashboard):
    tokens = httpx.get(f"{dashboard}/steps/train/1/trajectories/1/tokens").json()
    trained = [t["id"] for t in tokens["tokens"] if t["trained"]]
    assert trained == [8, 9] and tokens["trained_tokens"] == 2 and tokens["advantage"] > 0
    missing = httpx.get(f"{dashboard}/steps/train/1/trajectories/5/tokens")
    assert missing.status_code == 404 and "has 2 trajectories" in missing.json()["error"]["message"]


def test_arts_history_rows_chart_on_a_time_axis(dashboard):
    rows = httpx.get(f"{dashboard}/history").json()["rows"]
    expected = datetime(2026, 5, 1, 12, 0, 0).timestamp()
    assert [(r["step"], r["recorded_at"]) for r in rows] == [(0, expected), (1, expected)]
    assert all("split" not in r for r in rows)
