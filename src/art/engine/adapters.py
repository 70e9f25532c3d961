"""Switches the LoRA weights of a shared PeftModel per request.

On CPU the engine and the trainer share one PeftModel: the adapter being trained is the
"live" one (peft's adapter name `default`), older checkpoints are loaded on demand under their
own names, and the base model is served with adapters disabled. Callers hold the model lock.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator

from art.engine.base import AdapterRef
from art.errors import ModelNotFoundError

LIVE_ADAPTER = "default"


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


class AdapterSwitcher:
    def __init__(self, model, *, max_loaded: int = 4) -> None:
        self.model = model
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[str, None] = OrderedDict()  # LRU of checkpoint adapters

    @contextmanager
    def use(self, adapter: AdapterRef | None) -> Iterator[None]:
        """Make `adapter` the active weights for the duration of the block."""
        model = self.model
        if not _is_peft(model):
            if adapter is not None:
                raise ModelNotFoundError(f"adapter {adapter.key!r} requested but the model has no LoRA adapters")
            yield
            return
        if adapter is None:
            with model.disable_adapter():
                yield
            return
        if adapter.path is None:
            yield
            return
        name = self._ensure_loaded(adapter)
        model.set_adapter(name)
        try:
            yield
        finally:
            model.set_adapter(LIVE_ADAPTER)

    def _ensure_loaded(self, adapter: AdapterRef) -> str:
        name = "ckpt_" + adapter.key.replace(".", "_").replace("@", "_at_")
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return name
        if not adapter.path.exists():
            raise ModelNotFoundError(f"checkpoint for {adapter.key!r} not found at {adapter.path}")
        self.model.load_adapter(str(adapter.path), adapter_name=name, is_trainable=False)
        self._loaded[name] = None
        while len(self._loaded) > self.max_loaded:
            old, _ = self._loaded.popitem(last=False)
            self.model.delete_adapter(old)
        return name
