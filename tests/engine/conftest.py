"""Fixtures the engine tests share."""

import pytest

from tests.support.fakes import randomize_lora


@pytest.fixture()
def lora(tiny_model_path):
    """(the tiny model with a random rank-4 LoRA on q, v and down, in eval mode; its tokenizer)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                           LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                      target_modules=["q_proj", "v_proj", "down_proj"]))
    model.eval()
    randomize_lora(model, seed=5)
    return model, AutoTokenizer.from_pretrained(tiny_model_path)
