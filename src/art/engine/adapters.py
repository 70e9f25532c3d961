"""Which LoRA weights each row of a batch uses, on a PeftModel shared with the trainer.

The adapter being trained is the "live" one (peft's adapter name `default`); older checkpoints
are loaded on demand under their own names and kept in a small LRU (never evicted while a
running request uses them); `__base__` is the base model. A fully fine-tuned model (no peft)
serves its live weights only. peft's `adapter_names` forward argument lets one batch mix all
of them. Callers hold the model lock.

A batch that uses only the live adapter (the usual RL rollout) runs on merged weights,
W + B A s, computed once per weight update into new tensors: the LoRA path then costs nothing
(it was 17-45% of decoding time). The original base tensors are kept and swapped back, never
recomputed, so unmerging is exact. Anything that changes or trains the live adapter calls
`unmerge()` first (the trainer refuses merged weights).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from art.engine.base import AdapterRef
from art.errors import ModelNotFoundError
from art.weights import is_peft

if TYPE_CHECKING:
    import torch
    from peft.tuners.lora import LoraLayer

LIVE = "default"
BASE = "__base__"


class AdapterSet:
    def __init__(self, model, *, live_step: int = 0, max_loaded: int = 4, merge_live: bool = True) -> None:
        self.model = model
        self.merge_live = merge_live and is_peft(model)
        # (LoRA layer, its original weight); torch types a submodule's attribute as tensor or module.
        self._merged: list[tuple[LoraLayer, torch.Tensor | torch.nn.Module]] | None = None
        self.live_step = live_step
        """The training step whose weights the live adapter holds."""
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[str, None] = OrderedDict()  # checkpoint adapters, LRU order
        self._in_use: Counter[str] = Counter()
        self.frozen = False
        """A training step runs beside the engine: peft's module tree must not change (no
        checkpoint adapter is loaded or deleted) until it ends."""

    def acquire(self, ref: AdapterRef | None) -> tuple[str, int | None]:
        """The peft name serving `ref` now, and the step it holds; pair with `release`."""
        if ref is None:
            return BASE, None
        live = ref.step is None or ref.step == self.live_step or ref.path is None
        if not is_peft(self.model):
            if not live:  # full fine-tuning: only the weights in memory exist
                raise ModelNotFoundError(
                    f"{ref.key!r}: only the latest step ({self.live_step}) of a fully fine-tuned model is served"
                )
            self._in_use[LIVE] += 1
            return LIVE, self.live_step
        step: int | None
        if live:
            name, step = LIVE, self.live_step
        else:
            name, step = self._load(ref), ref.step
        self._in_use[name] += 1
        return name, step

    def must_wait(self, ref: AdapterRef | None) -> bool:
        """Whether serving `ref` needs a checkpoint loaded while the tree is frozen: such a
        request waits for the training step to end (the others are served meanwhile)."""
        if not self.frozen or ref is None or not is_peft(self.model):
            return False
        live = ref.step is None or ref.step == self.live_step or ref.path is None
        return not live and self._name(ref) not in self._loaded

    def release(self, name: str) -> None:
        if name != BASE:
            self._in_use[name] -= 1
        self._evict()

    @contextmanager
    def activate(self, names: list[str]) -> Iterator[dict]:
        """Set up the model for a forward pass whose rows use `names`; yields forward kwargs.
        (peft's `disable_adapter()` walks every module twice, ~45 ms a call on the default
        model; `adapter_names=["__base__", ...]` gives the base model for a fraction of that.)"""
        unique = set(names)
        if not is_peft(self.model):
            yield {}
        elif unique == {LIVE}:
            if self.merge_live:
                self._merge()
            yield {}
        else:
            self.unmerge()
            yield {"adapter_names": list(names)}

    def _merge(self) -> None:
        if self._merged is not None:
            return
        from peft.tuners.lora import LoraLayer

        merged = []
        for module in self.model.modules():
            if isinstance(module, LoraLayer) and LIVE in module.lora_A:
                base = module.get_base_layer()
                original = base.weight.data
                # A new tensor, so `original` stays untouched (peft's own merge adds in place or,
                # with safe_merge, clones and scans for NaNs: two more passes over the weights).
                delta = module.get_delta_weight(LIVE)  # type: ignore[attr-defined]  # peft's layer kinds define it
                base.weight.data = original + delta.to(original.dtype)
                module.merged_adapters.append(LIVE)
                merged.append((module, original))
        self._merged = merged

    def unmerge(self) -> None:
        """Put the exact base weights back (before training or a mixed-adapter batch)."""
        if self._merged is None:
            return
        for module, original in self._merged:
            module.get_base_layer().weight.data = original
            module.merged_adapters.clear()
        self._merged = None

    @staticmethod
    def _name(ref: AdapterRef) -> str:
        return "ckpt_" + ref.key.replace(".", "_").replace("@", "_at_")

    def _load(self, ref: AdapterRef) -> str:
        name = self._name(ref)
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return name
        if ref.path is None:
            raise RuntimeError(f"{ref.key!r} is the live adapter: it has no checkpoint to load")
        if not ref.path.exists():
            raise ModelNotFoundError(f"checkpoint for {ref.key!r} not found at {ref.path}")
        self.model.load_adapter(str(ref.path), adapter_name=name, is_trainable=False)
        self.model.set_adapter(LIVE)  # loading must not change what the trainer trains
        self._loaded[name] = None
        return name

    def _evict(self) -> None:
        if self.frozen:  # deleting an adapter changes the tree the trainer runs through: later
            return
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded:
                return
            if self._in_use[name] <= 0:
                del self._loaded[name]
                self.model.delete_adapter(name)
