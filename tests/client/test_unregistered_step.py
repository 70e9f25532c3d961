"""`model.get_step()` before `register`: a trainable model reads its stored run (where `register`
will resume) or says it is not registered; it never answers a silent 0 for a run at step 8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import art
from tests.support.fakes import groups_of_choices


def stored_run(base: Path, steps: list[int], *, leftover: int | None = None) -> None:
    run = base / "p" / "models" / "m"
    for step in steps:
        (run / "checkpoints" / f"{step:04d}").mkdir(parents=True)
    if leftover is not None:  # a crashed write: never a complete checkpoint
        (run / "checkpoints" / f".tmp-{leftover:04d}-x1y2").mkdir(parents=True)
    run.mkdir(parents=True, exist_ok=True)
    (run / "model.json").write_text(json.dumps({"name": "m", "project": "p", "base_model": "x"}))


async def test_reads_the_latest_complete_checkpoint_of_the_stored_run(tmp_path):
    stored_run(tmp_path, [0, 3, 8], leftover=9)
    model = art.TrainableModel(name="m", project="p", base_model="x", base_path=str(tmp_path))
    assert await model.get_step() == 8
    assert sorted(p.name for p in (tmp_path / "p" / "models" / "m" / "checkpoints").iterdir()) == [
        ".tmp-0009-x1y2", "0000", "0003", "0008"]  # read only: nothing cleaned up or written


async def test_a_run_without_checkpoints_yet_is_at_step_0(tmp_path):
    stored_run(tmp_path, [])
    model = art.TrainableModel(name="m", project="p", base_model="x", base_path=str(tmp_path))
    assert await model.get_step() == 0


async def test_no_stored_run_raises_not_registered(tmp_path):
    model = art.TrainableModel(name="m", project="p", base_model="x", base_path=str(tmp_path))
    with pytest.raises(art.ArtValueError, match="not registered") as info:
        await model.get_step()
    assert "register(backend)" in str(info.value) and str(tmp_path) in str(info.value)
    assert not (tmp_path / "p").exists()


async def test_a_plain_model_has_no_steps(tmp_path):
    assert await art.Model(name="m", project="p", base_path=str(tmp_path)).get_step() == 0  # as in ART


async def test_matches_the_step_register_resumes_at(tiny_model_path, tmp_path):
    async with art.LocalBackend(path=str(tmp_path)) as backend:
        model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path))
        await model.register(backend)
        await model.train(groups_of_choices(seed=1), config=art.TrainConfig(learning_rate=1e-2))
    again = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path), base_path=str(tmp_path))
    assert await again.get_step() == 1  # a script that resumes asks before it registers
    async with art.LocalBackend(path=str(tmp_path)) as backend:
        await again.register(backend)
        assert await again.get_step() == 1
