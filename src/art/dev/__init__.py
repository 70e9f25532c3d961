"""Advanced options (ART's `art.dev` names): per-call training options and model internals."""

from __future__ import annotations

from typing import TypedDict


class TrainConfig(TypedDict, total=False):
    """Options of one `train` call beyond `art.TrainConfig`. Defaults in `art.training.options`."""

    scale_rewards: bool
    """Divide each group's advantages by its reward std (+1e-6). Default True."""
    epsilon: float
    """Lower clip range of the importance ratio: ratios below 1 - epsilon are clipped. Default 0.2."""
    epsilon_high: float | None
    """Upper clip range (DAPO clip-higher); None uses `epsilon`. Default None."""
    max_grad_norm: float
    """Gradient-norm clip. Default 0.1."""
    micro_batch_tokens: int
    """Padded tokens per forward pass (memory bound; the update is the same). Default 4096."""


class PeftArgs(TypedDict, total=False):
    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]


class EngineArgs(TypedDict, total=False):
    max_model_len: int
    """Context length served (prompt + completion); defaults to the model's."""
    max_num_seqs: int
    """Samples decoded together at most; more wait in a queue. Default 64."""
    kv_cache_bytes: int
    """Memory for running samples' KV cache; requests beyond it wait. Default 4 GiB."""
    prefix_cache_tokens: int
    """Prompt tokens whose KV is kept for reuse by later prompts. Default 16384."""


class InternalModelConfig(TypedDict, total=False):
    """Passed as `TrainableModel(_internal_config=...)`; stored in model.json."""

    peft_args: PeftArgs
    engine_args: EngineArgs
    seed: int
    """Seeds the LoRA initialisation at step 0. Default 0."""


__all__ = ["EngineArgs", "InternalModelConfig", "PeftArgs", "TrainConfig"]
