"""The cache of the rows that transformers' forward decodes together (`hf_runner.py`), cut into rows.

transformers keeps one cache layer per decoder layer: keys and values for an attention layer
(full or sliding-window), a convolution state and a recurrent state for a linear-attention or
Mamba layer (Qwen3.5's Gated DeltaNet, LFM2's short convolutions). The engine's rows join and
leave the batch between steps, so every layer's cache is cut into rows and put together again:
`LayerRows` is one layer's part for some rows, batch dimension first.

Attention layers keep every position, sliding-window ones included. transformers' sliding layer
keeps only its last `window` positions, which stop lining up with the padding mask once rows of
different lengths share the batch (the runner's intermittent "The size of tensor a (37) must match
the size of tensor b (2)"). The mask applies the window instead: transformers builds it in column
space, which is exact because every row's tokens are contiguous and end at the last column.
A recurrent state needs no mask: a row's state is its own, and left padding enters a zero state
as zero inputs, which leave it zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionLayer


@dataclass
class LayerRows:
    """One layer's cache for some rows: an attention layer's keys and values [rows, heads, width,
    dim], or a recurrent layer's states by state index ([rows, ...] each). Empty before the layer
    has seen a token."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.keys is None and not self.conv and not self.recurrent

    def select(self, index: torch.Tensor) -> LayerRows:
        """These rows (in this order; an index may repeat: samples of one prompt)."""
        if self.empty:
            return self
        return LayerRows(
            None if self.keys is None else self.keys[index],
            None if self.values is None else self.values[index],
            {i: t[index] for i, t in self.conv.items()},
            {i: t[index] for i, t in self.recurrent.items()},
        )

    def widen(self, width: int) -> LayerRows:
        """Keys and values left-padded to `width` positions (states have no positions)."""
        if self.keys is None or self.values is None or self.keys.shape[2] == width:
            return self
        return LayerRows(pad_left(self.keys, width), pad_left(self.values, width), self.conv, self.recurrent)


def concat(parts: list[LayerRows]) -> LayerRows:
    """The rows of `parts` one after another, keys and values left-padded to the widest."""
    parts = [p for p in parts if not p.empty]
    if not parts:
        return LayerRows()
    width = max((p.keys.shape[2] for p in parts if p.keys is not None), default=0)
    parts = [p.widen(width) for p in parts]
    first = parts[0]
    return LayerRows(
        None if first.keys is None else torch.cat([p.keys for p in parts if p.keys is not None]),
        None if first.values is None else torch.cat([p.values for p in parts if p.values is not None]),
        {i: torch.cat([p.conv[i] for p in parts]) for i in first.conv},
        {i: torch.cat([p.recurrent[i] for p in parts]) for i in first.recurrent},
    )


def new_cache(config) -> DynamicCache:
    """An empty cache for `config`'s layers, attention layers keeping every position."""
    cache = DynamicCache(config=config)
    cache.layers = [
        layer if isinstance(layer, (LinearAttentionLayer, DummyLayer)) else GrowingLayer() for layer in cache.layers
    ]  # a layer with both a recurrent state and attention keeps transformers' class
    return cache


def read(cache: DynamicCache) -> list[LayerRows]:
    """Every layer's cache as rows (the tensors themselves, not copies). A layer may hold both
    kinds (Falcon-H1's runs Mamba2 and attention side by side)."""
    parts = []
    for layer in cache.layers:
        part = LayerRows()
        if isinstance(layer, LinearAttentionLayer):
            states = range(layer.number_of_states)
            part.conv = {i: t for i in states if (t := layer.conv_states[i]) is not None}
            part.recurrent = {i: t for i in states if (t := layer.recurrent_states[i]) is not None}
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(layer, DynamicLayer) and keys is not None and values is not None and keys.dim() == 4:
            part.keys, part.values = keys, values
        parts.append(part)
    return parts


def write(cache: DynamicCache, parts: list[LayerRows], width: int) -> None:
    """Make `cache` hold `parts` (one per layer), `width` columns of tokens so far."""
    for layer, part in zip(cache.layers, parts):
        if part.empty:  # a layer with no cache (a dense or MoE block in Nemotron-H), or nothing seen yet
            continue
        if part.conv or part.recurrent:
            if not isinstance(layer, LinearAttentionLayer):
                raise RuntimeError(f"a {type(layer).__name__} cache layer keeps no recurrent state")
            _set_states(layer, part, width)
        if part.keys is None or part.values is None:
            continue
        if isinstance(layer, GrowingLayer):
            layer.set(part.keys, part.values)
        elif isinstance(layer, DynamicLayer):  # beside a recurrent state: transformers' own, appending by copy
            layer.keys, layer.values = part.keys.contiguous(), part.values.contiguous()
            layer.device, layer.is_initialized = part.keys.device, True
        else:
            raise RuntimeError(f"cannot write keys and values into a {type(layer).__name__} cache layer")


def _set_states(layer: LinearAttentionLayer, part: LayerRows, width: int) -> None:
    first = next(iter({**part.conv, **part.recurrent}.values()))
    layer.device, layer.dtype = first.device, first.dtype  # type: ignore[assignment]  # typed None until set
    for i, state in part.conv.items():
        layer.conv_states[i] = state.contiguous()
        layer.conv_kernel_size[i] = state.shape[-1]
        layer.is_conv_states_initialized[i] = True
        layer.has_previous_state[i] = True
    for i, state in part.recurrent.items():
        layer.recurrent_states[i] = state.contiguous()
        layer.is_recurrent_states_initialized[i] = True
        layer.has_previous_state[i] = True
    # transformers counts a linear layer's tokens here; a cache whose first layer is linear
    # answers `get_seq_length` with it, and the masks' column offsets follow it.
    layer.cumulative_length_linear = torch.tensor(width, device=first.device)


class GrowingLayer(DynamicLayer):
    """An attention cache layer that appends into spare capacity instead of re-allocating every step.

    DynamicLayer concatenates (copies the whole layer) at each token; this writes in place and
    grows by doubling, so a decode step allocates almost nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = 0

    def set(self, keys: torch.Tensor, values: torch.Tensor, headroom: int = 32) -> None:
        rows, heads, tokens, dim = keys.shape
        self._k = k = keys.new_empty(rows, heads, tokens + headroom, dim)
        self._v = v = values.new_empty(rows, heads, tokens + headroom, values.shape[-1])
        k[:, :, :tokens] = keys
        v[:, :, :tokens] = values
        self._len = tokens
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True
        self.keys, self.values = k[:, :, :tokens], v[:, :, :tokens]

    def update(self, key_states, value_states, *args, **kwargs):
        if self._k is None or self._v is None:
            self.set(key_states, value_states)
            return self.keys, self.values
        new = key_states.shape[2]
        if self._len + new > self._k.shape[2]:
            self.set(self.keys, self.values, headroom=max(32, self._len))
        self._k[:, :, self._len : self._len + new] = key_states
        self._v[:, :, self._len : self._len + new] = value_states
        self._len += new
        self.keys, self.values = self._k[:, :, : self._len], self._v[:, :, : self._len]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len


def pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """Keys or values [rows, heads, tokens, dim] with zero columns before them, to `width` tokens."""
    return t if t.shape[2] == width else F.pad(t, (0, 0, width - t.shape[2], 0))
