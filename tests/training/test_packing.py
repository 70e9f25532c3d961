"""Packed and shared-prefix layouts give the same loss and gradients as one plain row per sequence."""

import random
from types import SimpleNamespace

import pytest
import torch

from art.training import packing
from art.training.batch import plan_micro_batches, split_mini_batches
from art.training.loss import Normalizer, policy_loss_terms, token_logprobs
from art.training.options import TrainOptions
from art.training.trainer import Trainer
from tests.support.fakes import make_groups, trainer_loss_and_grads

MODES = ("shared_prefix", "packed", "padded")


@pytest.fixture(scope="module")
def lora_model(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                           LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
            if "q_proj.base_layer" in name or "k_proj.weight" in name:
                p.mul_(12)  # sharp attention, so a wrong position or a leaked token shows
    return model


def reference_loss_and_grads(model, sequences, options):
    """Each sequence alone through the plain HF forward (full logits), no packing code."""
    normalizer = Normalizer(options.loss_normalization, sum(s.num_trained for s in sequences), len(sequences),
                            options.max_tokens_normalizer)
    epsilon, epsilon_high = options.clip_range()
    model.zero_grad()
    total = 0.0
    for s in sequences:
        ids = torch.tensor([s.token_ids])
        new = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
        mask = torch.tensor([s.trained[1:]], dtype=torch.float)
        old = torch.tensor([s.sampler_logprobs[1:]]).nan_to_num(0.0)
        terms = policy_loss_terms(new, old, torch.tensor([s.advantage]), mask, epsilon=epsilon,
                                  epsilon_high=epsilon_high, ppo=options.ppo,
                                  importance_sampling_level=options.importance_sampling_level,
                                  normalizer=normalizer)
        terms["loss"].backward()
        total += float(terms["loss"].detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return total, grads


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", [
    {},
    {"ppo": False, "importance_sampling_level": "sequence", "loss_normalization": "sequence"},
])
def test_every_layout_matches_plain_rows(lora_model, mode, objective):
    sequences = make_groups(turns=2)
    options = TrainOptions(packing=mode, micro_batch_tokens=64, packed_row_tokens=48, **objective)
    loss, grads, micro = trainer_loss_and_grads(lora_model, sequences, options)
    ref_loss, ref_grads = reference_loss_and_grads(lora_model, sequences, options)
    assert len(micro) > 1  # the split into micro-batches is part of what is checked
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_shared_prefix_computes_each_group_prompt_once():
    sequences = make_groups(groups=4, samples=8)
    budget = 10_000
    shared = plan_micro_batches(sequences, TrainOptions(packing="shared_prefix", micro_batch_tokens=budget))
    packed = plan_micro_batches(sequences, TrainOptions(packing="packed", micro_batch_tokens=budget))
    padded = plan_micro_batches(sequences, TrainOptions(packing="padded", micro_batch_tokens=budget))
    tokens = sum(len(s.token_ids) for s in sequences)
    row_tokens = lambda plan: sum(len(r.token_ids) for m in plan for r in m.rows)
    assert row_tokens(packed) == row_tokens(padded) == tokens  # every token once per sample
    # each group's common prompt (at least the 4 shortest prompt tokens) appears once, not 8 times
    assert row_tokens(shared) <= tokens - 4 * 7 * 4
    assert sum(m.tokens_computed for m in packed) < sum(m.tokens_computed for m in padded)


@pytest.mark.parametrize("mode", MODES)
def test_slots_reproduce_every_sequence_with_its_positions(mode):
    sequences = make_groups(seed=3, groups=3, samples=5, turns=2)
    plan = plan_micro_batches(sequences, TrainOptions(packing=mode, micro_batch_tokens=80, packed_row_tokens=40))
    seen = []
    for batch in plan:
        assert batch.tokens_computed <= 80 or len(batch.rows) == 1
        assert batch.causal or mode != "padded"
        mask = packing.attention_mask(batch.rows, batch.width, torch.float32)[:, 0] == 0  # [rows, q, k]
        used = torch.zeros(mask.shape[:2], dtype=torch.bool)
        for s, slots in zip(batch.sequences, batch.slots):
            seen.append(id(s))
            assert [batch.rows[r].token_ids[c] for r, c in slots] == s.token_ids
            assert [batch.rows[r].position_ids[c] for r, c in slots] == list(range(len(s.token_ids)))
            for t, (row, column) in enumerate(slots):  # each token sees exactly its sequence's slots up to it
                visible = set(mask[row, column].nonzero().flatten().tolist())
                assert visible == {c for r, c in slots[:t + 1]}
                used[row, column] = True
        for row, column in (~used).nonzero().tolist():  # padding sees only itself
            assert mask[row, column].nonzero().flatten().tolist() == [column]
    assert sorted(seen) == sorted(id(s) for s in sequences)


def masked_inputs(trainer, batch):
    """`batch`'s inputs as they were before the causal path: the 4D mask, padding at position 0."""
    inputs = batch.to_tensors(trainer.pad_id, trainer.device, trainer.dtype)
    real = torch.tensor([[c < len(r.token_ids) for c in range(batch.width)] for r in batch.rows])
    return inputs._replace(attention=packing.attention_mask(batch.rows, batch.width, torch.float32),
                           positions=inputs.positions * real)


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_one_sequence_rows_take_the_causal_path_with_the_masked_logprobs(lora_model, mode, monkeypatch):
    """A micro-batch of one sequence per row reaches SDPA with no mask and is_causal; its trained
    logprobs equal those of the same batch under the 4D mask within float noise. Packed rows
    keep their mask."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    trainer = Trainer(lora_model, SimpleNamespace(pad_token_id=0))
    options = TrainOptions(packing=mode, micro_batch_tokens=4096, packed_row_tokens=48)
    (batch,) = plan_micro_batches(make_groups(seed=5, turns=2), options)
    assert batch.causal == (mode == "padded")
    assert len({len(r.token_ids) for r in batch.rows}) > 1  # right padding is part of what is checked
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        plain = trainer.token_logprobs(batch.to_tensors(trainer.pad_id, trainer.device, trainer.dtype))
        assert set(calls) == {(mode == "padded", mode == "padded")}
        masked = trainer.token_logprobs(masked_inputs(trainer, batch))
    difference = float((plain - masked).abs().max())
    assert difference < 1e-5, difference
    if mode == "padded":
        assert batch.to_tensors(trainer.pad_id, trainer.device, trainer.dtype).attention is None


def test_mini_batches_keep_groups_together_and_cover_the_batch():
    sequences = make_groups(groups=4, samples=3)
    random.Random(0).shuffle(sequences)
    parts = split_mini_batches(sequences, 2)
    assert [len(p) for p in parts] == [6, 6]
    assert [sorted({s.group for s in p}) for p in parts] == [[0, 1], [2, 3]]
