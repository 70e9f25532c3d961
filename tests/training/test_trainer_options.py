"""Trainer options beyond the loss: gradient checkpointing, mini-batches and epochs, full
fine-tuning, and a pinned training curve that catches any silent change to the update."""

from types import SimpleNamespace

import pytest
import torch

import art
from art.training.options import TrainOptions
from art.training.trainer import Trainer
from tests.support.fakes import greedy_logprobs, groups_of_choices, make_groups, one_step, trainer_loss_and_grads


def lora_model(path, seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                          LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]))


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model_path):
    model = lora_model(tiny_model_path)
    model.train()
    sequences = make_groups(turns=2)
    loss, grads, _ = trainer_loss_and_grads(model, sequences, TrainOptions())
    trainer = Trainer(model, SimpleNamespace(pad_token_id=0))
    trainer.set_gradient_checkpointing(True)
    assert model.get_base_model().is_activation_checkpointing
    checkpointed, checkpointed_grads, _ = trainer_loss_and_grads(model, sequences, TrainOptions())
    trainer.set_gradient_checkpointing(False)
    assert not model.get_base_model().is_activation_checkpointing
    assert checkpointed == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_mini_batches_and_epochs_take_that_many_optimizer_steps(tiny_model_path):
    groups = groups_of_choices(groups=4)
    one = Trainer(lora_model(tiny_model_path), SimpleNamespace(pad_token_id=0))
    several = Trainer(lora_model(tiny_model_path), SimpleNamespace(pad_token_id=0))
    calls = []
    single = one.step(groups, TrainOptions(learning_rate=1e-2))
    metrics = several.step(groups, TrainOptions(learning_rate=1e-2, mini_batches=2, epochs=3),
                           on_optimizer_step=lambda done, total, m: calls.append((done, total)))
    assert single["optimizer_steps"] == 1.0 and metrics["optimizer_steps"] == 6.0
    assert calls == [(i, 6) for i in range(1, 7)]
    # After the first optimizer step the policy has left the sampler's: ratios move, and
    # AdamW's step count says six updates happened.
    assert metrics["ratio_mean"] != pytest.approx(single["ratio_mean"], abs=1e-6)
    state = several.optimizer.state_dict()["state"]
    assert {int(v["step"]) for v in state.values()} == {6}


def test_a_weight_made_non_finite_by_the_optimizer_step_is_refused(tiny_model_path):
    """The one stacked check after the optimizer step finds a single NaN among all trained
    tensors, and the step fails as diverged (the caller rolls it back)."""
    trainer = Trainer(lora_model(tiny_model_path), SimpleNamespace(pad_token_id=0))
    assert trainer.weights_finite()
    step = trainer.optimizer.step

    def poisoned_step():
        step()
        with torch.no_grad():
            trainer.params[len(trainer.params) // 2].view(-1)[0] = float("nan")

    trainer.optimizer.step = poisoned_step
    with pytest.raises(art.ArtValueError, match="became NaN or Inf") as info:
        trainer.step(groups_of_choices(), TrainOptions(learning_rate=1e-3))
    assert info.value.field == "learning_rate" and not trainer.weights_finite()


def test_several_optimizer_steps_with_tis_need_precalculated_logprobs():
    with pytest.raises(art.ArtValueError, match="precalculate_logprobs"):
        TrainOptions.build(None, {"mini_batches": 2, "truncated_importance_sampling": 2.0})
    TrainOptions.build(None, {"mini_batches": 2, "truncated_importance_sampling": 2.0, "precalculate_logprobs": True})
    with pytest.raises(art.ArtValueError, match="packing"):
        TrainOptions.build(None, {"packing": "tight"})


@pytest.mark.integration
async def test_full_finetune_trains_every_weight_and_resumes(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="full", project="ft", base_model=str(tiny_model_path),
                               _internal_config={"full_finetune": True})
    await model.register(backend)
    service = backend.service.loaded(("ft", "full"))
    embedding_before = service.model.get_input_embeddings().weight.detach().clone()
    before = await greedy_logprobs(model, "full")
    for step in range(2):
        await one_step(model, step)
    assert await model.get_step() == 2
    after = await greedy_logprobs(model, "full")
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-4
    assert not torch.equal(service.model.get_input_embeddings().weight, embedding_before)  # not just a LoRA
    checkpoint = tmp_path / "ft" / "models" / "full" / "checkpoints" / "0002"
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "config.json").exists()
    # Only the live weights are served: older steps and the base id get a 404 that says why.
    assert await greedy_logprobs(model, "full@2") == pytest.approx(after, abs=1e-4)
    for name in ("full@0", str(tiny_model_path)):
        with pytest.raises(Exception, match="fully fine-tuned"):
            await greedy_logprobs(model, name)
    # The KL term needs the base model as reference: it is loaded and the step trains.
    groups = groups_of_choices()
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-3, beta=0.1))
    await backend.close()

    backend2 = art.LocalBackend(path=str(tmp_path))
    model2 = art.TrainableModel(name="full", project="ft", base_model=str(tiny_model_path),
                                _internal_config={"full_finetune": True})
    await model2.register(backend2)
    assert await model2.get_step() == 3
    reloaded = backend2.service.loaded(("ft", "full")).model.get_input_embeddings().weight
    assert torch.equal(reloaded, service.model.get_input_embeddings().weight)
    await backend2.close()


@pytest.mark.integration
async def test_full_finetune_with_peft_args_names_the_conflict(tiny_model_path, tmp_path):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="both", project="ft", base_model=str(tiny_model_path),
                               _internal_config={"full_finetune": True, "peft_args": {"r": 4}})
    with pytest.raises(art.ArtValueError, match="peft_args"):
        await model.register(backend)
    await backend.close()


# Five updates of a LoRA on the tiny model from fixed token ids: (loss, mean trainer logprob of
# the best sample's tokens) after each step. Any change to advantages, layout, loss or optimizer
# moves these; update them only for an intended change, and say why in the commit.
GOLDEN_CURVE = [
    (0.3289891, -10.4704418),
    (0.3268792, -10.2941122),
    (0.3251225, -10.2465715),
    (0.3256279, -10.2022715),
    (0.3240575, -10.1858578),
]


def training_curve(tiny_model_path):
    groups = groups_of_choices(seed=7, groups=2, samples=4)
    trainer = Trainer(lora_model(tiny_model_path, seed=3), SimpleNamespace(pad_token_id=0))
    best = max(groups[0].trajectories, key=lambda t: t.reward).messages_and_choices[-1]
    ids = torch.tensor([list(best.prompt_token_ids) + list(best.token_ids)])
    curve = []
    for _ in range(5):
        # PPO's clip, recorded before CISPO became the default (test_loss_options checks both losses).
        metrics = trainer.step(groups, TrainOptions(learning_rate=1e-2, max_grad_norm=1.0, mini_batches=2, ppo=True))
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, :-1].log_softmax(-1)
            picked = logits.gather(1, ids[0, 1:, None])[-len(best.token_ids):]
        curve.append((round(metrics["loss"], 7), round(float(picked.mean()), 7)))
    return curve


def test_golden_training_curve(tiny_model_path):
    curve = training_curve(tiny_model_path)
    logprobs = [logprob for _, logprob in curve]
    assert logprobs == sorted(logprobs) and logprobs[-1] > logprobs[0] + 0.2  # the best sample gained
    for (loss, logprob), (golden_loss, golden_logprob) in zip(curve, GOLDEN_CURVE, strict=True):
        assert loss == pytest.approx(golden_loss, abs=1e-5)
        assert logprob == pytest.approx(golden_logprob, abs=1e-5)


def multi_turn_groups(groups: int = 2, samples: int = 3) -> tuple[list[art.TrajectoryGroup], int]:
    """Groups of two-turn trajectories (a completion, a tool result, a second completion): each
    one sequence of prompt + completion + tool + completion; (the groups, their tokens)."""
    import random

    from tests.support.fakes import make_choice

    rng, out, tokens = random.Random(7), [], 0
    for _ in range(groups):
        prompt = [rng.randrange(5, 900) for _ in range(6)]
        trajectories = []
        for i in range(samples):
            first = [rng.randrange(5, 900) for _ in range(2 + i)]
            tool = [rng.randrange(5, 900) for _ in range(3)]
            second = [rng.randrange(5, 900) for _ in range(2)]
            turns = [make_choice(prompt, first, [-6.5] * len(first)),
                     make_choice(prompt + first + tool, second, [-6.5] * len(second))]
            trajectories.append(art.Trajectory(messages_and_choices=[
                {"role": "user", "content": "x"}, turns[0], {"role": "tool", "tool_call_id": "c", "content": "y"},
                turns[1]], reward=float(i % 2)))
            tokens += len(prompt + first + tool + second)
        out.append(art.TrajectoryGroup(trajectories))
    return out, tokens


def test_a_cpu_step_first_says_what_it_trains_on_and_about_how_long(tiny_model_path, capsys):
    """Issue 45: before each step on the CPU, one line: the tokens and sequences it trains on
    and an estimate at the rate the step before measured (the first has none)."""
    import re

    trainer = Trainer(lora_model(tiny_model_path), SimpleNamespace(pad_token_id=0))
    groups, tokens = multi_turn_groups()
    first = trainer.step(groups, TrainOptions(learning_rate=1e-2), desc="train step 0")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[art] train step")]
    assert lines == [f"[art] train step 0: training on {tokens:,} tokens in 6 sequences (first step: no estimate yet)"]
    assert first["tokens_in_batch"] == tokens and first["sequences"] == 6.0
    rate = trainer.last_tokens_per_s
    assert rate and rate > 0

    trainer.step(groups[:1], TrainOptions(learning_rate=1e-2, epochs=2), desc="train step 1")
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[art] train step")]
    half = tokens // 2  # the first group's
    found = re.fullmatch(rf"\[art\] train step 1: training on {half:,} tokens in 3 sequences x 2 epochs "
                         r"\(~([\d.]+) s at the last step's ([\d,]+) tok/s\)", line)
    assert found, line
    assert float(found.group(2).replace(",", "")) == pytest.approx(rate, abs=0.5)
    assert float(found.group(1)) == pytest.approx(2 * half / rate, rel=0.06, abs=0.01)

    trainer.step(groups, TrainOptions(learning_rate=1e-2), desc="rank 1", quiet=True)  # a peer rank says nothing
    assert "[art]" not in capsys.readouterr().out
