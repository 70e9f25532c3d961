"""Training in bf16 the way a GPU runs it: LoRA on bf16 base weights, and full fine-tuning with
float32 master weights served in bf16. On the CPU (bf16 is slow there but exact in the same way)
and, when there is one, on CUDA. The weight-sync probe (trainer vs engine logprobs) passes at
every step within the bf16 tolerance, and a tiny model learns a simple target."""

from __future__ import annotations

import pytest
import torch

import art
from art.service import probe
from tests.support.devices import DEVICES

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("full_finetune", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("device", DEVICES)
async def test_bf16_training_agrees_with_serving_and_learns(tiny_model_path, tmp_path, device, full_finetune):
    """The target: tokens whose embedding lies on one side of a fixed random direction (half the
    vocabulary, and a direction the model can learn). Its probability mass at the first
    completion position must rise."""
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="learn", project="p", base_model=str(tiny_model_path), _internal_config={
        "full_finetune": full_finetune, "engine_args": {"device": device, "dtype": "bfloat16"}})
    await model.register(backend)
    service = backend.service.loaded(("p", "learn"))
    assert service.trainer.device.type == device and service.trainer.dtype == torch.bfloat16
    weights_dtype = next(service.model.parameters()).dtype
    assert weights_dtype == (torch.float32 if full_finetune else torch.bfloat16)  # master weights vs a shared bf16 base
    embeddings = service.model.get_input_embeddings().weight.detach().float().cpu()
    direction = torch.randn(embeddings.shape[1], generator=torch.Generator().manual_seed(0))
    good = (embeddings @ direction > 0).nonzero().flatten()
    good_set = set(good.tolist())
    client = model.openai_client()
    messages = [{"role": "user", "content": "Go."}]

    async def rollout(seed: int) -> art.Trajectory:
        completion = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=4,
                                                          seed=seed, extra_body={"ignore_eos": True})
        ids = completion.choices[0].token_ids
        return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]],
                              reward=sum(i in good_set for i in ids) / len(ids))

    async def target_mass() -> float:
        completion = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=1)
        prompt = torch.tensor([completion.choices[0].prompt_token_ids], device=device)
        with service.engine.paused(), torch.no_grad():
            logprobs = service.model(input_ids=prompt).logits[0, -1].float().log_softmax(-1)
        return float(logprobs[good.to(device)].exp().sum())

    before = await target_mass()
    for step in range(12):
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(1000 * step + 10 * g + i) for i in range(8)) for g in range(4)],
            pbar_desc=None)
        result = await backend.train(model, groups, learning_rate=1e-3 if full_finetune else 5e-2)
        assert result.metrics[probe.METRIC] <= probe.HALF_TOLERANCE
        if device == "cuda":
            assert result.metrics["peak_gpu_memory_gb"] > 0
    after = await target_mass()
    await backend.close()
    assert after > before + 0.03, (before, after)
