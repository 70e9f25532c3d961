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

Mixture-of-experts models carry LoRA on their fused 3-D expert parameters (peft's
`target_parameters`, a `ParamWrapper` per parameter). peft cannot mix adapters within one
forward pass there, so on such a model a pass serves one adapter (`mixes_in_one_pass` is False)
and the runner splits a mixed batch by adapter. A checkpoint is then not a second peft adapter:
its tensors are kept aside and stand in for the live adapter's during its passes (the tensors
are swapped, not copied). peft 0.22 also mis-targets a second adapter on models whose dense or
shared-expert MLPs share their names with the fused experts (GLM-4.5's `mlp.gate_proj` beside
`mlp.experts.gate_up_proj`), which this avoids.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from art.engine.base import AdapterRef
from art.errors import ModelNotFoundError
from art.weights import is_peft

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

LIVE = "default"
BASE = "__base__"


class AdapterSet:
    def __init__(self, model, *, live_step: int = 0, max_loaded: int = 4, merge_live: bool = True) -> None:
        self.model = model
        self.merge_live = merge_live and is_peft(model)
        # (LoRA layer, its original weight)
        self._merged: list[tuple[LoraLayer, torch.Tensor]] | None = None
        self.live_step = live_step
        """The training step whose weights the live adapter holds."""
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[str, None] = OrderedDict()  # checkpoint adapters, LRU order
        self._tensors: dict[str, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
        """A checkpoint's LoRA tensors beside the live parameters they stand in for, where a pass
        serves one adapter."""
        self._in_use: Counter[str] = Counter()
        self._layers: list[LoraLayer] | None = None
        self.frozen = False
        """A training step runs beside the engine: peft's module tree must not change (no
        checkpoint adapter is loaded or deleted) until it ends."""
        from peft.tuners.lora.layer import ParamWrapper

        self.mixes_in_one_pass = not any(isinstance(m, ParamWrapper) for m in model.modules())
        """Whether one forward pass may give its rows different adapters (peft's `adapter_names`):
        not with LoRA on expert parameters."""

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
        elif self.mixes_in_one_pass:
            self.unmerge()
            yield {"adapter_names": list(names)}
        elif len(unique) == 1:
            self.unmerge()
            with self._only(names[0]):
                yield {}
        else:
            raise ValueError(
                f"adapters {sorted(unique)} in one pass: LoRA on expert parameters serves one adapter a pass"
            )

    @contextmanager
    def _only(self, name: str) -> Iterator[None]:
        """The model computes with adapter `name` alone for the duration: the base model (no LoRA
        layer applies an adapter: peft has no public switch that leaves requires_grad alone, so
        the layers' active list is set and put back), the live adapter, or a checkpoint's tensors
        in place of the live ones."""
        if name == BASE:
            layers = self._lora_layers()
            saved = [layer._active_adapter for layer in layers]
            try:
                for layer in layers:
                    layer._active_adapter = [BASE]
                yield
            finally:
                for layer, active in zip(layers, saved):
                    layer._active_adapter = active
            return
        swapped = self._tensors.get(name, [])
        live = [param.data for param, _ in swapped]
        try:
            for param, tensor in swapped:
                param.data = tensor
            yield
        finally:
            for (param, _), tensor in zip(swapped, live):
                param.data = tensor

    def _lora_layers(self) -> list[LoraLayer]:
        """Found once: `_only` runs where checkpoints are tensors, not peft adapters, so peft's
        module tree never changes under it."""
        if self._layers is None:
            from peft.tuners.lora import LoraLayer

            self._layers = [m for m in self.model.modules() if isinstance(m, LoraLayer)]
        return self._layers

    def _merge(self) -> None:
        if self._merged is not None:
            return
        from peft.tuners.lora import LoraLayer

        merged = []
        for module in self.model.modules():
            if isinstance(module, LoraLayer) and LIVE in module.lora_A:
                weight = adapted_weight(module)
                original = weight.data
                # A new tensor, so `original` stays untouched (peft's own merge adds in place or,
                # with safe_merge, clones and scans for NaNs: two more passes over the weights).
                delta = module.get_delta_weight(LIVE)  # type: ignore[attr-defined]  # peft's layer kinds define it
                weight.data = original + delta.to(original.dtype)
                module.merged_adapters.append(LIVE)
                merged.append((module, original))
        self._merged = merged

    def unmerge(self) -> None:
        """Put the exact base weights back (before training or a mixed-adapter batch)."""
        if self._merged is None:
            return
        for module, original in self._merged:
            adapted_weight(module).data = original
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
        if self.mixes_in_one_pass:
            self.unmerge()  # peft's set_adapter would unmerge a merged model its own way
            self.model.load_adapter(str(ref.path), adapter_name=name, is_trainable=False)
            self.model.set_adapter(LIVE)  # loading must not change what the trainer trains
        else:
            self._tensors[name] = self._checkpoint_tensors(ref.path)
        self._loaded[name] = None
        return name

    def _checkpoint_tensors(self, path) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """A checkpoint's adapter tensors, each beside the live parameter it stands in for, on its device."""
        from art.weights import read_adapter

        live = {n: p for n, p in self.model.named_parameters() if "lora_" in n and f".{LIVE}." in n}
        by_saved_name = {n.replace(f".{LIVE}.", ".", 1): n for n in live}
        saved = read_adapter(path)
        odd = sorted(set(saved) ^ set(by_saved_name))[:3]
        odd += [k for k, t in saved.items() if k in by_saved_name and t.shape != live[by_saved_name[k]].shape][:3]
        if odd:
            raise ModelNotFoundError(f"checkpoint {path} does not match the live adapter's layout: {odd}")
        with torch.inference_mode(False):  # plain tensors: they stand in for parameters
            pairs = [(live[by_saved_name[k]], t) for k, t in saved.items()]
            return [(param, t.to(param.device, param.dtype).clone()) for param, t in pairs]

    def _evict(self) -> None:
        if self.frozen:  # deleting an adapter changes the tree the trainer runs through: later
            return
        for name in list(self._loaded):
            if len(self._loaded) <= self.max_loaded:
                return
            if self._in_use[name] <= 0:
                del self._loaded[name]
                if self._tensors.pop(name, None) is None:
                    self.model.delete_adapter(name)


def adapted_weight(layer: LoraLayer) -> torch.Tensor:
    """The base tensor a LoRA layer adapts: a linear layer's weight, or the expert parameter a
    peft `ParamWrapper` targets (e.g. `experts.gate_up_proj`, [experts, out, in])."""
    from peft.tuners.lora.layer import ParamWrapper

    weight = layer.get_param() if isinstance(layer, ParamWrapper) else layer.get_base_layer().weight
    assert isinstance(weight, torch.Tensor)
    return weight
