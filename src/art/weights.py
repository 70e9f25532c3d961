"""Moving weights in and out of a model: checkpoint folders and the live adapter's tensors.

One module reads and writes them, for the trainer (`Trainer.save`/`restore`), sharded ranks
(`art.training.fsdp`), engine replicas (`art.engine.replicas.load_weights`) and the service.
A LoRA checkpoint is peft's `adapter_model.safetensors`; a fully fine-tuned one is HF's
`model*.safetensors` shards, servable by vLLM either way. torch, peft and safetensors are
imported on use, so the module sits on the ground floor.
"""

from __future__ import annotations

from pathlib import Path

ADAPTER_FILE = "adapter_model.safetensors"


def is_peft(model) -> bool:
    """A peft model (LoRA adapters around a transformers model), as opposed to one trained whole."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def base_of(model):
    """The transformers model a peft model wraps (the model itself when it is not one)."""
    return model.get_base_model() if is_peft(model) else model


def read_shards(folder: Path) -> dict:
    """Every tensor of a fully fine-tuned checkpoint's safetensors shards, by name."""
    from safetensors.torch import load_file

    weights: dict = {}
    for shard in sorted(Path(folder).glob("model*.safetensors")):
        weights.update(load_file(str(shard)))
    return weights


def load_full_weights(model, folder: Path) -> None:
    """A fully fine-tuned checkpoint (HF safetensors shards) into `model`, every weight checked."""
    weights = read_shards(folder)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"checkpoint {folder} does not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )


def read_adapter(folder: Path) -> dict:
    """A LoRA checkpoint's adapter tensors, by peft's names."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / ADAPTER_FILE))


def write_adapter(model, folder: Path) -> None:
    """The live adapter of PeftModel `model` as a peft checkpoint in `folder`."""
    model.save_pretrained(str(folder), selected_adapters=["default"])


def adapter_tensors(model) -> dict:
    """The live adapter's tensors, copied to the CPU (what replicas load to hold the live weights)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}
