"""What an engine is built with: one frozen `EngineConfig`, in vLLM's names.

`_internal_config={"engine_args": {...}}` written for ART (whose engine is vLLM) is read by
`EngineConfig.from_engine_args`: the names that mean something here are honoured, the other
vLLM engine args are accepted with one warning naming them, and a name vLLM does not have
either is refused (a typo should not pass silently). `resolve()` turns "auto" into a concrete
device and dtype; nothing downstream guesses either.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from art.checks import boolean, int_at_least, number_in, one_of
from art.errors import ArtValueError

log = logging.getLogger(__name__)

DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# vLLM engine args (the names in ART's `art.dev.EngineArgs`) this engine has no use for. They are
# accepted so ART scripts run unchanged, and named once in a warning.
IGNORED_VLLM_ARGS = frozenset(
    """
    model served_model_name tokenizer skip_tokenizer_init tokenizer_mode trust_remote_code
    allowed_local_media_path download_dir load_format kv_cache_dtype seed pipeline_parallel_size
    tensor_parallel_size max_parallel_loading_workers block_size disable_sliding_window
    use_v2_block_manager swap_space cpu_offload_gb max_num_partial_prefills max_long_partial_prefills
    long_prefill_token_threshold max_logprobs disable_log_stats revision code_revision rope_scaling
    rope_theta tokenizer_revision quantization max_seq_len_to_capture disable_custom_all_reduce
    tokenizer_pool_size tokenizer_pool_extra_config limit_mm_per_prompt mm_processor_kwargs
    disable_mm_preprocessor_cache enable_lora enable_lora_bias max_lora_rank enable_prompt_adapter
    max_prompt_adapters max_prompt_adapter_token fully_sharded_loras lora_extra_vocab_size
    long_lora_scaling_factors lora_dtype max_cpu_loras num_scheduler_steps multi_step_stream_outputs
    ray_workers_use_nsight num_gpu_blocks_override num_lookahead_slots model_loader_extra_config
    ignore_patterns preemption_mode scheduler_delay_factor enable_chunked_prefill
    guided_decoding_backend logits_processor_pattern speculative_model speculative_model_quantization
    speculative_draft_tensor_parallel_size num_speculative_tokens speculative_disable_mqa_scorer
    speculative_max_model_len speculative_disable_by_batch_size ngram_prompt_lookup_max
    ngram_prompt_lookup_min spec_decoding_acceptance_method
    typical_acceptance_sampler_posterior_threshold typical_acceptance_sampler_posterior_alpha
    qlora_adapter_name_or_path disable_logprobs_during_spec_decoding otlp_traces_endpoint
    collect_detailed_traces disable_async_output_proc scheduling_policy scheduler_cls
    override_neuron_config worker_cls generation_config override_generation_config
    enable_sleep_mode model_impl calculate_kv_scales additional_config disable_log_requests
    enable_log_requests compilation_config hf_overrides
""".split()
)

# vLLM names for our fields.
RENAMED_VLLM_ARGS = {"max_num_batched_tokens": "prefill_tokens", "max_loras": "max_loaded_adapters"}

CPU_MAX_NUM_SEQS = 256
CUDA_MAX_NUM_SEQS = 64
"""`max_num_seqs` when none is given, by device (see the field)."""

_warned: set[str] = set()


def warn_ignored(keys, where: str) -> None:
    """One warning per process for each ignored key."""
    new = sorted(k for k in keys if f"{where}.{k}" not in _warned)
    if new:
        _warned.update(f"{where}.{k}" for k in new)
        log.warning(
            "ignoring %s %s: this backend has no use for %s (accepted for ART compatibility)",
            where,
            ", ".join(new),
            "it" if len(new) == 1 else "them",
        )


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"
    """"auto": CUDA when available, else the CPU; or "cpu", "cuda", "cuda:1"."""
    dtype: str = "auto"
    """Compute dtype of serving: "auto" is bfloat16 on CUDA and float32 on the CPU."""
    max_num_seqs: int | None = None
    """Samples decoded together at most; more wait in a queue. None: 256 on the CPU (vLLM's
    classic default), 64 on CUDA. On the CPU a decode step's cost grows far slower than its rows
    up to a few hundred (the matmuls only then reach the cores' peak), so a burst of rollouts
    (ART's yes_no_maybe: 288 at once) finishes sooner in one wide batch than in waves of 64; the
    KV memory is bounded by `kv_cache_bytes` either way. On CUDA fewer when
    `gpu_memory_utilization` does not fit this many rows of 256 tokens."""
    max_model_len: int | None = None
    """Context length served (prompt + completion). None: the model's own."""
    gpu_memory_utilization: float = 0.5
    """CUDA: the engine's share, weights included, of the GPU memory available when it starts
    (free memory plus what PyTorch's allocator caches unused: `memory.py`); the KV cache is sized
    once from what is left of it. The rest is the trainer's (activations, optimizer), and a
    second model on the GPU takes its share of what the first left."""
    enforce_eager: bool | None = None
    """CUDA: never capture decode steps in CUDA graphs. None: eager, until a GPU run proves the
    graphs (the first H200 run left graph replay differing from eager decoding); False: graphs."""
    kv_cache_bytes: int = 4 << 30
    """CPU: memory for running samples' keys and values; requests beyond it wait. 4 GiB."""
    prefix_cache_tokens: int = 16384
    """Prompt tokens whose keys and values are kept for reuse by later prompts; 0: none."""
    prefill_tokens: int = 4096
    """Padded prompt tokens per prefill pass (vLLM's max_num_batched_tokens): bounds its memory. A
    longer prompt is prefilled in blocks of this many tokens."""
    max_loaded_adapters: int = 4
    """Checkpoint adapters (`name@step`) kept loaded beside the live one (vLLM's max_loras)."""
    merge_lora: bool | None = None
    """Serve live-adapter batches from weights with the LoRA merged in (a second copy of the
    adapted weights). None: on the CPU yes (packed for oneDNN: 1.4-2.3x a decode step), on CUDA
    no (one copy of the weights; the LoRA runs inside the CUDA graph). Models served through
    transformers' forward (`hf_runner.py`) merge unless this is False."""
    pad_batches: bool | None = None
    """Pad decode batches to a few bucket sizes (static shapes). None: on CUDA, where each bucket
    is one CUDA graph; on the CPU padding only costs time."""
    kv_layout: str | None = None
    """"fixed": one KV buffer of positions laid out with each step's width as its stride, widths
    doubling from 256, keys repeated per query head in masked prefills (CUDA's, for its graphs);
    "growable": a cache that grows with the work (the CPU's). None: by device. "fixed" on the
    CPU runs CUDA's layout code where tests can check it without a GPU."""
    ignored: tuple[str, ...] = field(default=(), compare=False)
    """The vLLM engine args that were given and ignored (for the record)."""

    @classmethod
    def from_engine_args(cls, engine_args: dict | None) -> EngineConfig:
        """From ART's / vLLM's `engine_args` dict; raises ArtValueError naming unknown or bad keys."""
        args = dict(engine_args or {})
        ours = {f.name for f in fields(cls)} - {"ignored"}
        values: dict[str, Any] = {}  # engine_args' values, checked by `validate`
        ignored: list[str] = []
        unknown: list[str] = []
        for key, value in args.items():
            name = RENAMED_VLLM_ARGS.get(key, key)
            if key == "enable_prefix_caching":
                if value is False:
                    values["prefix_cache_tokens"] = 0
            elif name in ours:
                values[name] = value
            elif key in IGNORED_VLLM_ARGS:
                ignored.append(key)
            else:
                unknown.append(key)
        if unknown:
            raise ArtValueError(
                f"unknown engine_args {', '.join(map(repr, sorted(unknown)))}: this engine takes "
                f"{', '.join(sorted(ours | set(RENAMED_VLLM_ARGS) | {'enable_prefix_caching'}))} "
                "and accepts (ignoring) the rest of vLLM's engine args",
                field=f"engine_args.{sorted(unknown)[0]}",
            )
        warn_ignored(ignored, "engine_args")
        config = cls(**values, ignored=tuple(sorted(ignored)))
        config.validate()
        return config

    def validate(self) -> None:
        """Every bad field at once; `field` names the first."""
        checks = {"kv_layout": one_of("engine_args.kv_layout", self.kv_layout, ("fixed", "growable", None))}
        for name, low, none_ok in (
            ("max_num_seqs", 1, True),  # None: by device (`resolve`)
            ("kv_cache_bytes", 1, False),
            ("prefill_tokens", 1, False),
            ("max_loaded_adapters", 1, False),
            ("prefix_cache_tokens", 0, False),
            ("max_model_len", 1, True),
        ):
            checks[name] = int_at_least(f"engine_args.{name}", getattr(self, name), low, none_ok=none_ok)
        checks["gpu_memory_utilization"] = number_in(
            "engine_args.gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True
        )
        checks["dtype"] = one_of("engine_args.dtype", self.dtype, ("auto", *DTYPES))
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            checks["device"] = f"engine_args.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}"
        for name in ("enforce_eager", "merge_lora", "pad_batches"):
            checks[name] = boolean(f"engine_args.{name}", getattr(self, name), none_ok=True)
        problems = [(name, problem) for name, problem in checks.items() if problem]
        if problems:
            raise ArtValueError("; ".join(message for _, message in problems), field=f"engine_args.{problems[0][0]}")

    def resolve(self, model=None) -> EngineConfig:
        """A copy with a concrete device ("cpu", "cuda:0") and dtype ("float32", ...). With `model`
        (already loaded), "auto" means where its weights are and their dtype."""
        import torch

        self.validate()
        device, dtype = self.device, self.dtype
        if model is not None:
            weights = next(model.parameters())
            device = str(weights.device) if device == "auto" else device
            dtype = str(weights.dtype).removeprefix("torch.") if dtype == "auto" else dtype
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ArtValueError(
                    f"engine_args.device={self.device!r} but this torch has no CUDA device "
                    f"(torch {torch.__version__}); use 'auto' or 'cpu'",
                    field="engine_args.device",
                )
            device = str(torch.device(device if ":" in device else f"cuda:{torch.cuda.current_device()}"))
        dtype = DTYPES.get(dtype) or ("bfloat16" if device.startswith("cuda") else "float32")
        rows = self.max_num_seqs or (CUDA_MAX_NUM_SEQS if device.startswith("cuda") else CPU_MAX_NUM_SEQS)
        eager = True if self.enforce_eager is None else self.enforce_eager
        return dataclasses.replace(self, device=device, dtype=dtype, max_num_seqs=rows, enforce_eager=eager)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, DTYPES.get(self.dtype, "float32"))

    @property
    def resolved_max_num_seqs(self) -> int:
        """`max_num_seqs` of a resolved config (`resolve` chooses it by device when None)."""
        if self.max_num_seqs is None:
            raise RuntimeError("max_num_seqs is None until EngineConfig.resolve() chooses it: resolve the config first")
        return self.max_num_seqs

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def fixed_kv_layout(self) -> bool:
        """CUDA's KV layout (`kv_layout`)."""
        return self.kv_layout == "fixed" or (self.kv_layout is None and self.on_cuda)
