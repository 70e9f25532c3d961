"""The model-support matrix (docs/models.md): every architecture family served and trained end to end.

For each family a tiny random model built by transformers' own config and modeling code goes
through the README's loop: register, chat rollouts through the official client, a LoRA step
(the weight-sync probe passing), the step served. Then the engine serves a mixed batch, the
base model, the live adapter and step 0's adapter reloaded from its checkpoint, with rows of
different lengths joining and leaving, sampled with several seeds, past the sliding windows, and
every sampled sequence's logprobs must equal the trainer-side forward pass over the same ids.
That is the check a wrong mask, a stale or mixed-up adapter, or a recurrent state leaking
between rows fails (the intermittent runner fault of issue 53 failed it every time).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import art
from art.engine.base import SamplingParams
from art.service import probe
from art.storage.layout import ModelDir
from tests.support import families
from tests.support.rollouts import rollout

pytestmark = pytest.mark.integration

PROMPTS = [[1, 5, 9], list(range(100, 109)), list(range(200, 217)), list(range(300, 330)), list(range(100, 113))]
"""Lengths around and past the sliding windows (6); two share a 9-token prefix."""


@pytest.fixture(scope="module")
def tokenizer():
    return families.tokenizer()


async def served_batch(service, refs):
    """Mixed requests (the refs in turn), n=2, several seeds and lengths, all at once."""
    work = []
    for seed in range(2):
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(n=2, temperature=1.0, max_tokens=4 + 3 * i, seed=10 * seed + i)
            work.append((prompt, params, refs[(i + seed) % len(refs)]))
    results = await asyncio.gather(*[service.engine.generate(p, params, ref) for p, params, ref in work])
    return [(prompt, ref, c) for (prompt, _, ref), got in zip(work, results) for c in got]


def forward_logprobs(service, ref, prompt: list[int], completion: list[int]) -> list[float]:
    """log p of each completion token after the prompt, one plain forward pass with `ref`'s adapter."""
    adapters = service.engine.adapters
    name, _ = adapters.acquire(ref)
    try:
        ids = torch.tensor([prompt + completion])
        with adapters.activate([name]) as extra:
            logits = service.model(input_ids=ids, **extra).logits[0, len(prompt) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        return logprobs.tolist()
    finally:
        adapters.release(name)


def worst_difference(service, served) -> float:
    """The largest gap between a served logprob and the plain forward pass's over the same ids."""
    with service.engine.paused():
        return max(
            max(abs(a - b) for a, b in zip(c.logprobs, forward_logprobs(service, ref, prompt, c.token_ids)))
            for prompt, ref, c in served
        )


async def train_step(backend, model, step: int) -> dict:
    """One LoRA step on four chat rollouts with rewards that differ (so it really trains)."""
    trajectories = [await rollout(model, 10 * step + seed) for seed in range(4)]
    assert {t.messages_and_choices[-1].step for t in trajectories} == {step}  # sampled by the step before
    for rank, trajectory in enumerate(trajectories):
        trajectory.reward = float(rank)
    result = await backend.train(model, [art.TrajectoryGroup(trajectories)], learning_rate=0.05)
    assert result.step == step + 1 and "nothing_to_train" not in result.metrics
    assert result.metrics[probe.METRIC] <= probe.TOLERANCE
    return result.metrics


async def greedy(service, name: str):
    (completion,) = await service.engine.generate(PROMPTS[3], GREEDY, service.resolve(name).adapter)
    return completion


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("model_type", list(families.FAMILIES))
async def test_family_serves_and_trains(model_type, tokenizer, tmp_path):
    path = families.save_tiny(model_type, tmp_path / model_type, tokenizer)
    config = {"engine_args": {"max_num_seqs": 16}}
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    model = art.TrainableModel(name="m", project="matrix", base_model=str(path), _internal_config=config)
    await model.register(backend)
    service = backend.service.loaded(("matrix", "m"))
    try:
        # The README's loop: chat rollouts through the client, LoRA steps, each step served.
        await train_step(backend, model, 0)
        if model_type in families.MOE_FAMILIES:  # the routed experts carry LoRA, and it trained
            lora = dict(service.model.named_parameters())
            experts = [n for n in lora if ".experts." in n and "lora_B" in n]
            assert experts and all(lora[n].abs().sum() > 0 for n in experts)
            assert not any("lora" in n and (".gate.weight" in n or ".router." in n) for n in lora)  # router frozen
        step1 = await greedy(service, "m")
        await train_step(backend, model, 1)
        after = await rollout(model, 99)
        assert after.messages_and_choices[-1].token_ids  # step 2 serves

        # Step 1 reloaded from its checkpoint serves what the live adapter served at step 1.
        reloaded = await greedy(service, "m@1")
        assert reloaded.step == 1 and reloaded.token_ids == step1.token_ids
        assert reloaded.logprobs == pytest.approx(step1.logprobs, abs=1e-4)
        # Base, live and step 1 in one batch: every sampled sequence's logprobs are the plain
        # forward pass's over the same ids.
        refs = [service.resolve(m).adapter for m in (str(path), "m", "m@1")]
        served = await served_batch(service, refs)
        worst = worst_difference(service, served)
        assert worst < 1e-4, worst
        assert {c.step for _, _, c in served} == {None, 1, 2}
        step2 = await greedy(service, "m")
    finally:
        await backend.close()

    # A new backend resumes at step 2 from the checkpoint and serves what was served before.
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    model = art.TrainableModel(name="m", project="matrix", base_model=str(path), _internal_config=config)
    await model.register(backend)
    try:
        resumed = await greedy(backend.service.loaded(("matrix", "m")), "m")
        assert resumed.step == 2 and resumed.token_ids == step2.token_ids
        assert resumed.logprobs == pytest.approx(step2.logprobs, abs=1e-4)
    finally:
        await backend.close()


def expert_lora(service) -> set[str]:
    """Which fused expert parameters carry a LoRA (peft's ParamWrapper names them)."""
    from peft.tuners.lora.layer import ParamWrapper

    return {m.parameter_name for m in service.model.modules() if isinstance(m, ParamWrapper)}


@pytest.mark.parametrize(("lora_config", "wrapped"), [
    ({}, {"gate_up_proj", "down_proj"}),  # the default: the routed experts too
    ({"target_modules": ["q_proj", "v_proj"], "target_parameters": []}, set()),  # the user's: attention only
    ({"target_parameters": ["down_proj"]}, {"down_proj"}),
])
async def test_the_users_lora_targets_override_the_defaults(tokenizer, tmp_path, lora_config, wrapped):
    path = families.save_tiny("qwen3_moe", tmp_path / "moe", tokenizer)
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    model = art.TrainableModel(name="m", project="p", base_model=str(path),
                               _internal_config={"lora_config": lora_config})
    await model.register(backend)
    try:
        service = backend.service.loaded(("p", "m"))
        assert expert_lora(service) == wrapped
        if "target_modules" in lora_config:
            adapted = {n.split(".")[-1] for n, m in service.model.named_modules() if hasattr(m, "lora_A")}
            assert adapted - {"experts"} == {"q_proj", "v_proj"}
        await train_step(backend, model, 0)  # trains and passes the probe whatever the targets
    finally:
        await backend.close()


async def test_full_fine_tuning_of_a_mixture_of_experts_model(tokenizer, tmp_path):
    path = families.save_tiny("qwen3_moe", tmp_path / "moe", tokenizer)
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    model = art.TrainableModel(name="m", project="p", base_model=str(path), _internal_config={"full_finetune": True})
    await model.register(backend)
    try:
        service = backend.service.loaded(("p", "m"))
        experts = {n: p.detach().clone() for n, p in service.model.named_parameters() if ".experts." in n}
        assert experts
        await train_step(backend, model, 0)
        changed = [n for n, p in service.model.named_parameters() if n in experts and not torch.equal(p, experts[n])]
        assert changed  # the experts themselves trained
        assert (await greedy(service, "m")).step == 1
    finally:
        await backend.close()


async def test_an_unmerged_expert_lora_serves_what_the_trainer_computes(tokenizer, tmp_path):
    """merge_lora=False: live batches run peft's expert LoRA in the forward pass (CUDA's default)."""
    path = families.save_tiny("qwen3_moe", tmp_path / "moe", tokenizer)
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    model = art.TrainableModel(name="m", project="p", base_model=str(path),
                               _internal_config={"engine_args": {"merge_lora": False}})
    await model.register(backend)
    try:
        service = backend.service.loaded(("p", "m"))
        await train_step(backend, model, 0)
        assert not service.engine.adapters.merge_live  # the expert LoRA runs inside the forward pass
        served = await served_batch(service, [service.resolve("m").adapter])
        worst = worst_difference(service, served)
        assert worst < 1e-4, worst
    finally:
        await backend.close()


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "falcon_h1"])
async def test_full_fine_tuning_of_a_hybrid_model(model_type, tokenizer, tmp_path):
    """Every weight trains, recurrent layers included, and the probe passes on what is served."""
    path = families.save_tiny(model_type, tmp_path / model_type, tokenizer)
    backend = art.LocalBackend(path=str(tmp_path / "art"))
    model = art.TrainableModel(name="m", project="p", base_model=str(path), _internal_config={"full_finetune": True})
    await model.register(backend)
    try:
        service = backend.service.loaded(("p", "m"))
        recurrent = {n: p.detach().clone() for n, p in service.model.named_parameters()
                     if ".linear_attn." in n or ".mamba." in n}
        assert recurrent
        await train_step(backend, model, 0)  # asserts the probe
        assert any(not torch.equal(p, recurrent[n]) for n, p in service.model.named_parameters() if n in recurrent)
        served = await served_batch(service, [service.resolve("m").adapter])
        worst = worst_difference(service, served)
        assert worst < 1e-4, worst
    finally:
        await backend.close()
