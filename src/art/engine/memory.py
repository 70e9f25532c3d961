"""How many KV-cache positions an engine may allocate on its GPU.

`gpu_memory_utilization` is the engine's share of the memory that was available when it
started, its own weights included: what the device has free plus what PyTorch's caching
allocator holds without using it (`memory_reserved - memory_allocated`, which `mem_get_info`
counts as used). So an engine built after another model, a freed engine or an HF `generate`
in the same process sees the same memory, and a second model on the GPU takes its share of
what the first one left instead of nothing. From the share come the weights already loaded,
the copies the engine will prepare (merged LoRA, bf16 copies of float32 masters) and a
reserve for what a step allocates on the side (prefill activations and masks, the prefill
workspace, the prefix cache, logits and sampling); the rest is the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from art.engine.config import EngineConfig
from art.errors import ArtValueError

GIB = 1 << 30
SLACK = 512 << 20
"""For CUDA graphs' pool, the allocator's rounding and fragmentation."""


@dataclass(frozen=True)
class KVBudget:
    positions: int
    """KV positions (one token of one row, every layer) that fit."""
    available: int
    share: int
    weights: int
    reserve: int

    def describe(self) -> str:
        return (
            f"gpu_memory_utilization's share is {self.share / GIB:.2f} GiB of {self.available / GIB:.2f} GiB "
            f"available (counting {self.weights / GIB:.2f} GiB of this model's weights and copies), and "
            f"{self.reserve / GIB:.2f} GiB is reserved for prefill, logits and the prefix cache"
        )


def model_bytes(model, device: torch.device) -> int:
    """Bytes of `model`'s parameters and buffers on `device` (shared tensors once)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device == device and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def kv_budget(config: EngineConfig, model, *, bytes_per_position: int, reserve: int, copies: int = 0) -> KVBudget:
    """The KV positions that fit in the engine's share of its GPU (`config.device`)."""
    device = torch.device(config.device)
    free, _ = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    weights = model_bytes(model, device) + copies
    share = int(config.gpu_memory_utilization * (available + weights))
    positions = max(0, (share - weights - reserve - SLACK) // bytes_per_position)
    return KVBudget(positions, available, share, weights, reserve + SLACK)


def memory_error(what: str) -> ArtValueError:
    return ArtValueError(
        f"{what}. Raise engine_args.gpu_memory_utilization, or lower engine_args.max_model_len "
        "or engine_args.max_num_seqs",
        field="engine_args.gpu_memory_utilization",
    )
