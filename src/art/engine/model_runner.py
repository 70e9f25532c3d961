"""Tensor work of the engine: prefill one prompt, and decode one token for every running row.

The running batch keeps one KV cache whose rows are left-padded to a common width, with the
matching attention mask; rows join (padded to the width) and leave between steps. Positions
are per row, so padding never shifts a token's position.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from art.engine.adapters import AdapterSet
from art.engine.prefix_cache import KV


class ModelRunner:
    def __init__(self, model, adapters: AdapterSet) -> None:
        self.model = model
        self.adapters = adapters
        self.config = model.config
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # transformers 5.x renamed `past_key_values` to `cache`; accept both.
        self.cache_kw = "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"

    def forward(self, ids, mask, positions, cache, adapter_names: list[str]) -> torch.Tensor:
        """Logits at the last position of each row: [rows, vocab] float32."""
        with self.adapters.activate(adapter_names) as extra:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}, **extra)
        return out.logits[:, -1, :].float()

    def prefill(self, prompt: list[int], prefix_len: int, prefix_kv: KV | None, adapter: str):
        """Run the prompt after its cached prefix; returns (last logits [1, vocab], prompt kv)."""
        prefix_len = min(prefix_len, len(prompt) - 1)  # always compute the last prompt token
        cache = DynamicCache(config=self.config)
        if prefix_len > 0 and prefix_kv is not None:
            cache = DynamicCache(
                ddp_cache_data=[(k[:, :, :prefix_len], v[:, :, :prefix_len]) for k, v in prefix_kv],
                config=self.config)
        ids = torch.tensor([prompt[prefix_len:]])  # [1, new]
        positions = torch.arange(prefix_len, len(prompt))[None]  # [1, new]
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        logits = self.forward(ids, mask, positions, cache, [adapter])
        return logits, [(layer.keys, layer.values) for layer in cache.layers]


class GrowingLayer(DynamicLayer):
    """A cache layer that appends into spare capacity instead of re-allocating every step.

    DynamicLayer concatenates (copies the whole layer) at each token; this writes in place and
    grows by doubling, so a decode step allocates almost nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._k = self._v = None
        self._len = 0

    def set(self, keys: torch.Tensor, values: torch.Tensor, headroom: int = 32) -> None:
        rows, heads, tokens, dim = keys.shape
        self._k = keys.new_empty(rows, heads, tokens + headroom, dim)
        self._v = values.new_empty(rows, heads, tokens + headroom, dim)
        self._k[:, :, :tokens] = keys
        self._v[:, :, :tokens] = values
        self._len = tokens
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = self._k[:, :, :tokens], self._v[:, :, :tokens]

    def update(self, key_states, value_states, *args, **kwargs):
        if self._k is None:
            self.set(key_states, value_states)
            return self.keys, self.values
        new = key_states.shape[2]
        if self._len + new > self._k.shape[2]:
            self.set(self.keys, self.values, headroom=max(32, self._len))
        self._k[:, :, self._len:self._len + new] = key_states
        self._v[:, :, self._len:self._len + new] = value_states
        self._len += new
        self.keys, self.values = self._k[:, :, :self._len], self._v[:, :, :self._len]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len


def _growing_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):  # full attention only
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


class RunningBatch:
    """KV, mask and rows of the samples being decoded together."""

    def __init__(self, config) -> None:
        self.config = config
        self.rows: list = []  # Sample per row
        self.cache = _growing_cache(config)
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [rows, width]

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list, kv: KV) -> None:
        """Append rows whose cache is `kv` (per layer [len(rows), heads, tokens, dim])."""
        new_width = kv[0][0].shape[2]
        width = max(self.mask.shape[1], new_width)
        new_mask = torch.ones(len(rows), new_width, dtype=torch.long)
        for layer, (k, v) in zip(self.cache.layers, kv):
            if self.rows:
                k = torch.cat([_pad_left(layer.keys, width), _pad_left(k, width)])
                v = torch.cat([_pad_left(layer.values, width), _pad_left(v, width)])
            _set(layer, k, v)
        if self.rows:
            new_mask = torch.cat([F.pad(self.mask, (width - self.mask.shape[1], 0)),
                                  F.pad(new_mask, (width - new_width, 0))])
        self.mask = new_mask
        self.rows += rows

    def keep(self, keep: list[int]) -> None:
        """Keep only these row indices; drop columns no remaining row attends to."""
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = _growing_cache(self.config)
            self.mask = torch.zeros(0, 0, dtype=torch.long)
            return
        index = torch.tensor(keep)
        first = int(self.mask[index].any(0).long().argmax())  # leading all-padding columns
        self.mask = self.mask[index, first:]
        for layer in self.cache.layers:
            _set(layer, layer.keys[index, :, first:], layer.values[index, :, first:])

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids [rows, 1], mask [rows, width + 1], positions [rows, 1] for one decode step."""
        ids = torch.tensor([[s.ids[-1]] for s in self.rows])
        positions = torch.tensor([[s.position] for s in self.rows])
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
        return ids, self.mask, positions


def _set(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(layer, GrowingLayer):
        layer.set(keys, values)
    else:
        layer.keys, layer.values = keys.contiguous(), values.contiguous()
        layer.is_initialized, layer.device = True, keys.device


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[2] == width else F.pad(t, (0, 0, width - t.shape[2], 0))
