"""model.log forwards to a real W&B run in offline mode."""

import art
from art.observability import wandb_sink


async def test_log_reaches_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = art.Model(name="wb-model", project="wb-project", base_path=str(tmp_path))
    group = art.TrajectoryGroup([art.Trajectory(reward=r) for r in (0.0, 1.0)])
    try:
        await model.log([group], split="val", step=3)
        await model.log([group], split="train", metrics={"loss": 0.25}, step=1)  # out of step order
        run = wandb_sink._runs[("wb-project", "wb-model")]
        assert run.summary["val/reward"] == 0.5 and run.summary["train/loss"] == 0.25
        assert run.summary["training_step"] == 1
        run_dir = tmp_path / "wb-project" / "models" / "wb-model" / "wandb"
        assert any(p.name.startswith("offline-run") for p in run_dir.iterdir())
    finally:
        wandb_sink.finish_wandb()


async def test_wandb_stays_off_unless_configured(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    model = art.Model(name="quiet", project="wb-project", base_path=str(tmp_path))
    await model.log([art.TrajectoryGroup([art.Trajectory(reward=1.0)])], split="val")
    assert ("wb-project", "quiet") not in wandb_sink._runs
    assert not (tmp_path / "wb-project" / "models" / "quiet" / "wandb").exists()
