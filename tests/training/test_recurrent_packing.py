"""Packing and recurrent layers: a mask does not stop a recurrence.

Qwen3.5's Gated DeltaNet layers (and Mamba, LFM2's convolutions) carry a state from token to
token. In a row that packs several sequences, the block-diagonal mask keeps attention apart, but
the state of one sequence flows on into the next: the logprobs look plausible and are wrong. So
the trainer gives every sequence a row of its own on such a model (`Trainer.packing_mode`), and
the logprobs equal each sequence's forward pass alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from art.training.batch import plan_micro_batches
from art.training.loss import token_logprobs
from art.training.options import TrainOptions
from art.training.trainer import Trainer
from tests.support import families
from tests.support.fakes import make_groups


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3.5-MoE (a Gated DeltaNet layer, then full attention) with random LoRA factors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tok = families.tokenizer()
    path = families.save_tiny("qwen3_5_moe_text", tmp_path_factory.mktemp("hybrid"), tok)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, target_modules=["in_proj_qkv", "out_proj", "q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model.eval()


def alone(model, sequence) -> torch.Tensor:
    """One sequence's logprobs of its tokens 1..n, through the plain forward pass alone."""
    ids = torch.tensor([sequence.token_ids])
    return token_logprobs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])[0]


def trainer_logprobs(trainer, sequences, mode: str) -> tuple[list[torch.Tensor], int]:
    """The trainer's logprobs of each sequence's trained tokens under `mode`, and the most
    sequences any row held."""
    options = TrainOptions(packing=mode, micro_batch_tokens=4096, packed_row_tokens=64)
    out, most = [], 0
    for batch in plan_micro_batches(sequences, options):
        most = max(most, max(row.sequences for row in batch.rows))
        values = trainer.token_logprobs(batch.to_tensors(trainer.pad_id, trainer.device, trainer.dtype))
        out += [values[i, : len(s.token_ids) - 1] for i, s in enumerate(batch.sequences)]
    return out, most


def test_packed_rows_of_a_recurrent_model_give_each_sequence_its_own_logprobs(hybrid):
    sequences = make_groups(seed=3, groups=3, samples=1)  # three sequences, different prompts
    trainer = Trainer(hybrid, SimpleNamespace(pad_token_id=0))
    assert trainer.one_sequence_per_row and trainer.packing_mode("shared_prefix") == "padded"
    with torch.no_grad():
        expected = {id(s): alone(hybrid, s) for s in sequences}
        padded, most = trainer_logprobs(trainer, sequences, trainer.packing_mode("packed"))
        assert most == 1
        for s, got in zip(sequences, padded):
            trained = torch.tensor(s.trained[1:])
            torch.testing.assert_close(got[trained], expected[id(s)][trained], rtol=0, atol=1e-5)
        # The layout the trainer refuses: three sequences in one row under the block mask.
        packed, most = trainer_logprobs(trainer, sequences, "packed")
        assert most == 3
        leaked = max(float((got - expected[id(s)])[torch.tensor(s.trained[1:])].abs().max())
                     for s, got in zip(sequences, packed))
    assert leaked > 1e-3, leaked  # the second and third sequences inherit the first one's state
