"""Advanced options (ART's `art.dev` names): per-call training options and model internals."""

from __future__ import annotations

from typing import Literal, TypedDict


class TrainConfig(TypedDict, total=False):
    """Options of one `train` call beyond `art.TrainConfig`. Defaults in `art.training.options`."""

    scale_rewards: bool | Literal["group", "batch", "none"]
    """True/"group": divide advantages by the group's reward std (+1e-6); "batch": by the std of
    every reward in the batch; False/"none": no division (Dr. GRPO). Default True."""
    advantage_balance: float
    """In [-1, 1]: 1 trains only on positive advantages, -1 only on negative ones (the other side
    is scaled by 1 - |b|). Default 0.0 (balanced)."""
    entropy_bonus: float
    """Coefficient of the trained tokens' entropy, subtracted from the loss (verl's entropy_coeff):
    keeps sampling diverse so a better answer can still be found. Default 0.0."""
    ppo: bool
    """False: CISPO (clipped, detached importance weight times A * logp_new; ART's default).
    True: PPO clipped surrogate. Default False."""
    epsilon: float | None
    """Lower clip range of the importance ratio: ratios below 1 - epsilon are clipped.
    Default None: 0.2 with ppo, 1.0 without."""
    epsilon_high: float | None
    """Upper clip range (DAPO clip-higher). Default None: epsilon with ppo, 4.0 without."""
    importance_sampling_level: Literal["token", "sequence"]
    """"sequence": GSPO's per-sequence ratio on every token of the sequence. Default "token"."""
    loss_normalization: Literal["token", "sequence", "constant"]
    """"token" (DAPO): sum / trained tokens in the batch; "sequence" (GRPO): mean per sequence,
    then over sequences; "constant" (Dr. GRPO): sum / (sequences x max_tokens_normalizer).
    Default "token"."""
    max_tokens_normalizer: int | None
    """The constant length of "constant" normalisation (required by it). Default None."""
    precalculate_logprobs: bool
    """Take the ratio against the pre-update trainer logprobs, computed for the batch first,
    instead of the sampler's. Default False."""
    truncated_importance_sampling: float | None
    """TIS cap C: token loss x min(exp(logp_trainer - logp_sampler), C). Default None (off)."""
    max_grad_norm: float
    """Gradient-norm clip. Default 0.1."""
    micro_batch_tokens: int
    """Tokens per forward pass, rows x widest row (memory bound; the update is the same).
    Default 4096."""
    packing: Literal["shared_prefix", "packed", "padded"]
    """Layout of the forward pass (the update is the same): "shared_prefix" computes a group's
    common prompt once (group/parent attention mask) and packs rows without padding; "packed"
    packs whole sequences; "padded" is one padded row per sequence. Default "shared_prefix"."""
    packed_row_tokens: int
    """Longest packed row (attention work grows with it). Default 512."""
    gradient_checkpointing: bool
    """Recompute decoder-layer activations in the backward: less memory, ~1/3 more compute.
    Default False."""
    mini_batches: int
    """AdamW steps per epoch; the batch is split into this many parts. Default 1."""
    epochs: int
    """Passes over the batch (PPO epochs, TRL's num_iterations). Default 1."""


class TrainSFTConfig(TypedDict, total=False):
    """Options of one `train_sft` call beyond `art.TrainSFTConfig`. Defaults in
    `art.training.sft_options`."""

    max_grad_norm: float
    """Gradient-norm clip before each optimizer step. Default 1.0."""
    weight_decay: float
    """AdamW weight decay during SFT. Default 0.01."""
    micro_batch_tokens: int
    """Tokens per forward pass (memory bound; the update is the same). Default 4096."""
    packing: Literal["shared_prefix", "packed", "padded"]
    """Forward-pass layout; "shared_prefix" computes a batch's common prefix once. Default "shared_prefix"."""
    packed_row_tokens: int
    """Longest packed row. Default 512."""
    gradient_checkpointing: bool
    """Recompute decoder-layer activations in the backward. Default False."""


class PeftArgs(TypedDict, total=False):
    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]
    target_parameters: list[str]
    """Fused parameters to adapt (peft's `target_parameters`), e.g. ["gate_up_proj", "down_proj"]
    for the routed experts of a mixture-of-experts model: the default there; [] leaves them out."""


class EngineArgs(TypedDict, total=False):
    """vLLM's names; `art.engine.config.EngineConfig` documents each. The rest of vLLM's engine
    args are accepted and ignored with one warning; other names are refused."""

    device: str
    """"auto" (CUDA when available), "cpu", "cuda", "cuda:N"."""
    dtype: str
    """Serving compute dtype: "auto" (bfloat16 on CUDA, float32 on the CPU), "bfloat16", "float32"."""
    max_model_len: int
    """Context length served (prompt + completion); defaults to the model's."""
    max_num_seqs: int
    """Samples decoded together at most; more wait in a queue. Default 64."""
    gpu_memory_utilization: float
    """CUDA: share of GPU memory the engine may fill (weights + KV cache); the rest is the
    trainer's. Default 0.5."""
    enforce_eager: bool
    """CUDA: no CUDA graphs. Unset: eager until a GPU run proves the graphs; False turns them on."""
    kv_cache_bytes: int
    """CPU: memory for running samples' KV cache; requests beyond it wait. Default 4 GiB."""
    prefix_cache_tokens: int
    """Prompt tokens whose KV is kept for reuse by later prompts. Default 16384."""
    enable_prefix_caching: bool
    """False is prefix_cache_tokens=0."""
    max_num_batched_tokens: int
    """Padded prompt tokens per prefill pass. Default 4096."""
    max_loras: int
    """Checkpoint adapters (`name@step`) kept loaded. Default 4."""
    merge_lora: bool | None
    """Serve live-adapter batches on merged weights. Default None: on the CPU yes, on CUDA no
    (models served through transformers' forward: yes, unless False)."""
    pad_batches: bool | None
    """Pad decode batches to bucket sizes. Default None: on CUDA (one CUDA graph per bucket)."""


class LoRAConfig(TypedDict, total=False):
    """ART's newer names for the adapter (`lora_config`); mapped to peft's."""

    rank: int
    alpha: int
    dropout: float
    target_modules: list[str]
    target_parameters: list[str]
    """peft's `target_parameters` (a mixture-of-experts model's routed experts by default)."""
    use_rslora: bool


class InitArgs(TypedDict, total=False):
    """ART's `art.dev.InitArgs` (Unsloth's model loading): these three are honoured, the rest of
    Unsloth's keys are accepted and named once in a warning."""

    max_seq_length: int
    """The engine's max_model_len."""
    gpu_memory_utilization: float
    full_finetuning: bool


class InternalModelConfig(TypedDict, total=False):
    """Passed as `TrainableModel(_internal_config=...)`; stored in model.json. ART's other keys
    (`trainer_args`, `_decouple_vllm_and_unsloth`, most of `init_args`, ...) are accepted and
    named once in a warning: this backend has one process and one copy of the weights."""

    peft_args: PeftArgs
    lora_config: LoRAConfig
    engine_args: EngineArgs
    init_args: InitArgs
    """Unsloth's: `max_seq_length` (-> engine max_model_len), `gpu_memory_utilization` and
    `full_finetuning` are honoured."""
    seed: int
    """Seeds the LoRA initialisation at step 0. Default 0."""
    full_finetune: bool
    """Train every weight instead of a LoRA adapter (small models: memory is ~4x the weights
    for AdamW). Checkpoints hold the whole model; only the latest step is served, and the
    base model is not served beside it. Use a lower learning_rate than for LoRA (e.g. 1e-5).
    Default False."""


__all__ = ["EngineArgs", "InitArgs", "InternalModelConfig", "LoRAConfig", "PeftArgs", "TrainConfig", "TrainSFTConfig"]
