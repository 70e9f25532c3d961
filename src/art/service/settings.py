"""Read `TrainableModel(_internal_config=...)` once into typed settings for the backend.

ART scripts pass keys meant for vLLM, Unsloth and their trainer (`init_args`, `trainer_args`,
`_decouple_vllm_and_unsloth`, ...). Every key ART knows is accepted: those that mean something
here are honoured (`engine` and `vllm_python` (`art.service.engines`), `engine_args`,
`peft_args` or ART's newer `lora_config`, `seed`, `full_finetune` or `init_args.full_finetuning`,
`init_args.max_seq_length` and
`init_args.gpu_memory_utilization`, and ours, `trainer_ranks`, `fsdp`, `engine_replicas`,
`placement`, `serve_while_training` and `training_threads`); the rest are named once in a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from art.checks import boolean, int_at_least, int_in, integer, one_of
from art.engine.config import DTYPES, EngineConfig, warn_ignored
from art.errors import ArtValueError
from art.training.options import LORA_DEFAULTS

# ART's InternalModelConfig keys with no meaning for this backend.
IGNORED_KEYS = frozenset(
    {
        "trainer_args",
        "torchtune_args",
        "_decouple_vllm_and_unsloth",
        "trainer_gpu_ids",
        "inference_gpu_ids",
        "rollout_weights_mode",
        "rollout_weight_update_mode",
        "chat_template_kwargs",
        "chat_template",
        "chat_template_path",
        "chat_template_content_format",
        "chat_template_tool_schema_format",
        "vllm_runtime",
        "allow_unvalidated_arch",
        "megatron_model_initialization",
        "tinker_args",
        "tinker_native_args",
        "_log_vllm_metrics",
        "_use_pipeline_rl",
    }
)
PLACEMENTS = ("processes", "ray")
ENGINES = ("auto", "ours", "vllm")
"""Which engine serves: "ours" (`art.engine.llm_engine`), "vllm" (`art.engine.vllm_engine`), or
"auto": vLLM on CUDA when it is installed or named, ours otherwise (`art.service.engines`)."""
MAX_PROCESSES = 64
"""Trainer ranks or engine replicas of one model at most; far above the GPUs of one machine."""
# ART's newer `lora_config` names -> peft's LoraConfig names.
LORA_CONFIG_NAMES = {
    "rank": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target_modules": "target_modules",
    "target_parameters": "target_parameters",
    "bias": "bias",
    "use_rslora": "use_rslora",
    "layers_to_transform": "layers_to_transform",
    "modules_to_save": "modules_to_save",
    "init_weights": "init_lora_weights",
}


@dataclass(frozen=True)
class ModelSettings:
    engine: EngineConfig
    """Our engine's settings (with engine="vllm", the defaults: the trainer reads device and dtype)."""
    engine_kind: str | None = None
    """"auto", "ours" or "vllm"; None: the backend's default (`art serve --engine`, else "auto")."""
    engine_args: dict | None = None
    """The engine args as given (init_args' merged in): vLLM takes them as they are."""
    vllm_python: str | None = None
    """The Python that runs vLLM (None: $ART_VLLM_PYTHON, else this one)."""
    full_finetune: bool = False
    lora: dict | None = None
    """peft LoraConfig arguments (None under full fine-tuning)."""
    seed: int = 0
    """Seeds the LoRA initialisation at step 0."""
    trainer_ranks: int = 1
    """Data-parallel trainer ranks (`art.training.ranks`): rank 0 shares the engine's
    model, ranks 1..N-1 are processes of their own."""
    fsdp: bool = False
    """Full fine-tuning sharded over the trainer ranks with FSDP2 (`art.training.fsdp`):
    every rank is a process of its own, the backend keeps the engine's served copy."""
    engine_replicas: int = 1
    """Engine replicas behind the endpoint (`art.engine.replicas`): replica 0 is the engine
    that shares the trainer's model, replicas 1..N-1 are processes of their own."""
    dedicated_samplers: bool = False
    """Replicas 1..N-1 sample and replica 0, beside the trainer, stands in only while none of
    them is live: a sampler and a trainer on devices of their own (a GPU each, or a core each),
    the layout where overlapping rollouts with training pays most (`art.PipelineTrainer`)."""
    placement: str | None = None
    """Where replicas and ranks 1..N-1 run: "processes" (local) or "ray" (`art.ray_cluster`);
    None: the backend's default."""
    serve_while_training: bool | None = None
    """The engine keeps serving the last published step while a training step runs beside it
    on the same device (`art.service.update`). None: whenever the engine can (a LoRA adapter
    on a model the engine decodes itself); False: pause it for every step, as before."""
    training_threads: int | None = None
    """On the CPU, torch threads of a training step that runs beside the engine; the engine
    keeps the other cores (at least one). None: half the cores each."""


KNOWN_KEYS = frozenset(
    {
        "engine_args",
        "peft_args",
        "lora_config",
        "seed",
        "full_finetune",
        "init_args",
        "trainer_ranks",
        "fsdp",
        "engine_replicas",
        "placement",
        "serve_while_training",
        "training_threads",
        "dedicated_samplers",
        "engine",
        "vllm_python",
    }
)
"""The `_internal_config` keys that mean something here (the rest are ART's, named in a warning)."""
INIT_ARGS = ("max_seq_length", "gpu_memory_utilization", "full_finetuning")
"""The `init_args` keys (Unsloth's) that mean something here."""


def parse_internal_config(internal: dict | None) -> ModelSettings:
    """Raises ArtValueError naming the field for what cannot be honoured as given."""
    internal = dict(internal or {})
    init = dict(internal.get("init_args") or {})
    warn_ignored([k for k in internal if k not in KNOWN_KEYS], "_internal_config")
    warn_ignored([k for k in init if k not in INIT_ARGS], "init_args")
    engine = _engine_settings(internal, init)
    weights = _weight_settings(internal, init)
    processes = _process_settings(internal, full=weights["full_finetune"])
    if engine["engine_kind"] == "vllm":
        _refuse_scaling_with_vllm(processes)
    return ModelSettings(**engine, **weights, **processes)


def _engine_settings(internal: dict, init: dict) -> dict[str, Any]:
    """Which engine serves and with what args, grouped so `engine_args` is checked by the engine that takes it."""
    engine_args = dict(internal.get("engine_args") or {})
    if "max_seq_length" in init:  # Unsloth's context length; vLLM's max_model_len wins when both are given
        engine_args.setdefault("max_model_len", init["max_seq_length"])
    if "gpu_memory_utilization" in init:
        engine_args.setdefault("gpu_memory_utilization", init["gpu_memory_utilization"])
    kind = internal.get("engine")
    _refuse(one_of("engine", kind, (*ENGINES, None)), "engine")
    vllm_python = internal.get("vllm_python")
    if vllm_python is not None and (not isinstance(vllm_python, str) or not vllm_python):
        raise ArtValueError(
            f"vllm_python must be the path of a Python executable, got {vllm_python!r}", field="vllm_python"
        )
    # vLLM checks its own args when it starts (`art.service.engines`); ours are checked here. With
    # vLLM the trainer computes in the dtype vLLM serves in, so the probe compares like with like.
    if kind == "vllm":
        engine = EngineConfig(dtype=engine_args["dtype"] if engine_args.get("dtype") in DTYPES else "auto")
    else:
        engine = EngineConfig.from_engine_args(engine_args)
    return {"engine": engine, "engine_kind": kind, "engine_args": engine_args, "vllm_python": vllm_python}


def _weight_settings(internal: dict, init: dict) -> dict[str, Any]:
    """What is trained (the whole model or a LoRA adapter) and its seed: the group the others depend on."""
    full = _flag("full_finetune", internal.get("full_finetune", init.get("full_finetuning", False)))
    lora_given = {**internal.get("peft_args", {}), **_lora_config(internal.get("lora_config"))}
    if full and lora_given:
        key = "peft_args" if "peft_args" in internal else "lora_config"
        raise ArtValueError(f"{key} has no effect with full_finetune=True; drop one of them", field=key)
    seed = internal.get("seed", 0)
    _refuse(integer("seed", seed), "seed")
    return {"full_finetune": full, "lora": None if full else {**LORA_DEFAULTS, **lora_given}, "seed": seed}


def _process_settings(internal: dict, full: bool) -> dict[str, Any]:
    """How many processes train and serve, and where: together, as they constrain each other."""
    counts = {}
    for key in ("trainer_ranks", "engine_replicas"):
        counts[key] = internal.get(key, 1)
        _refuse(int_in(key, counts[key], 1, MAX_PROCESSES), key)
    placement = internal.get("placement")
    _refuse(one_of("placement", placement, (*PLACEMENTS, None)), "placement")
    fsdp = _flag("fsdp", internal.get("fsdp", False))
    if fsdp and not full:
        raise ArtValueError(
            "fsdp shards a fully fine-tuned model; set full_finetune=True too (a LoRA adapter is "
            "small enough to train whole on each rank: use trainer_ranks alone)",
            field="fsdp",
        )
    serve = internal.get("serve_while_training")
    _refuse(boolean("serve_while_training", serve, none_ok=True), "serve_while_training")
    if serve and full:
        raise ArtValueError(
            "serve_while_training needs a LoRA adapter: a fully fine-tuned model's served weights are "
            "the trained ones; drop one of them",
            field="serve_while_training",
        )
    threads = internal.get("training_threads")
    _refuse(int_at_least("training_threads", threads, 1, none_ok=True), "training_threads")
    dedicated = _flag("dedicated_samplers", internal.get("dedicated_samplers", False))
    if dedicated and counts["engine_replicas"] < 2:
        raise ArtValueError(
            "dedicated_samplers leaves sampling to replicas 1..N-1: set engine_replicas to 2 or more",
            field="dedicated_samplers",
        )
    return {
        **counts,
        "placement": placement,
        "fsdp": fsdp,
        "serve_while_training": serve,
        "training_threads": threads,
        "dedicated_samplers": dedicated,
    }


def _refuse_scaling_with_vllm(processes: dict[str, Any]) -> None:
    """vLLM scales with its own engine_args, so our replicas, ranks and FSDP are refused beside it."""
    for key, value in (
        ("engine_replicas", processes["engine_replicas"] > 1),
        ("trainer_ranks", processes["trainer_ranks"] > 1),
        ("fsdp", processes["fsdp"]),
    ):
        if value:
            raise ArtValueError(
                f"{key} is not available with engine='vllm' yet (vLLM scales with its own "
                "engine_args, e.g. data_parallel_size); use engine='ours' for it",
                field=key,
            )


def _refuse(problem: str | None, field: str) -> None:
    """Raise a check's problem at once: these settings are refused one at a time, in order."""
    if problem:
        raise ArtValueError(problem, field=field)


def _flag(key: str, value) -> bool:
    """`value` of the switch `key`; anything but True or False is an ArtValueError naming it."""
    _refuse(boolean(key, value), key)
    return bool(value)


def _lora_config(config) -> dict:
    if not config:
        return {}
    if not isinstance(config, dict):
        raise ArtValueError(f"lora_config must be an object, got {config!r}", field="lora_config")
    ignored = [k for k in config if k not in LORA_CONFIG_NAMES]
    warn_ignored(ignored, "lora_config")
    return {LORA_CONFIG_NAMES[k]: v for k, v in config.items() if k in LORA_CONFIG_NAMES}
