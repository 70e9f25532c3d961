"""Keys and values of a batch: row i of the batch lives in slot i, every layer in one tensor.

Keys and values each live in one flat buffer per layer, seen as [layers, slots, kv_heads,
stride, head_dim]: a slot holds `stride` positions. Moving a row is one indexing op per layer,
and a decode step attends over the view [:rows, :, :width] of a layer.

The stride is not fixed at `max_tokens`. On CUDA the buffer is allocated once, as a number of
positions (`capacity`), and the runner lays it out with the stride equal to the attention width
of the step (`arrange`): short rows leave room for many slots, and the view a CUDA graph reads
for a (rows, width) is always the same memory. On the CPU the buffer grows as work needs it and
is released when the engine idles. Changing the layout copies only the live rows, one layer at
a time, so the temporary is one layer's worth.

Prefix-cache entries use the same layout without the slot axis: (keys, values), each
[layers, kv_heads, tokens, head_dim].
"""

from __future__ import annotations

import torch

PrefixKV = tuple[torch.Tensor, torch.Tensor]  # keys, values [layers, kv_heads, tokens, head_dim]


class KVCache:
    def __init__(
        self,
        *,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_rows: int,
        max_tokens: int,
        growable: bool,
        capacity: int | None = None,
    ) -> None:
        self.shape = (layers, heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.growable = growable
        self.capacity = max_rows * max_tokens if capacity is None else capacity
        """Positions the buffer holds (a fixed cache); a growable one allocates up to this many."""
        self.rows_moved = 0
        """Slots copied by `copy_rows` within this cache (rows moved into the slots of finished ones)."""
        self.relayouts = 0
        """Times `arrange` moved live rows to another stride."""
        positions, stride = (0, 0) if growable else (self.capacity, max_tokens)
        self._k, self._v = self._buffer(positions), self._buffer(positions)  # [layers, positions * heads * dim]
        self._view(min(stride, max_tokens) if positions else 0)

    def _buffer(self, positions: int) -> torch.Tensor:
        layers, heads, dim = self.shape
        # Zeros, not empty: masked positions must still hold finite keys (0 x -inf is NaN).
        return torch.zeros(layers, positions * heads * dim, dtype=self.dtype, device=self.device)

    def _view(self, stride: int) -> None:
        layers, heads, dim = self.shape
        positions = self._k.shape[1] // (heads * dim)
        slots = min(self.max_rows, positions // stride) if stride else 0
        size = slots * heads * stride * dim
        self.k = self._k[:, :size].view(layers, slots, heads, stride, dim)  # [layers, slots, heads, stride, dim]
        self.v = self._v[:, :size].view(layers, slots, heads, stride, dim)

    @property
    def rows(self) -> int:
        """Slots in the current layout."""
        return self.k.shape[1]

    @property
    def tokens(self) -> int:
        """Positions per slot in the current layout (the stride)."""
        return self.k.shape[3]

    @property
    def bytes_per_token(self) -> int:
        layers, heads, dim = self.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def slots_at(self, stride: int) -> int:
        """Slots a layout of this stride has (a fixed cache)."""
        return min(self.max_rows, self.capacity // stride)

    def arrange(self, rows: int, stride: int, *, live: int, length: int) -> None:
        """Lay the buffer out as `rows` (at least) slots of exactly `stride` positions, keeping the
        first `length` positions of the first `live` slots. A growable cache reallocates when
        its buffer is too small; a fixed one raises."""
        if stride == self.tokens and rows <= self.rows:
            return
        if stride > self.max_tokens or rows > self.max_rows or rows * stride > self.capacity:
            raise ValueError(
                f"KV cache of {self.capacity} positions ({self.max_rows} slots x {self.max_tokens} at "
                f"most) cannot hold {rows} x {stride}"
            )
        old_k, old_v, old_stride = self.k, self.v, self.tokens
        keep = min(length, old_stride, stride)
        heads, dim = self.shape[1:]
        if rows * stride * heads * dim > self._k.shape[1]:
            if not self.growable:  # unreachable: capacity was checked
                raise ValueError("KV cache buffer too small")
            self._k, self._v = self._buffer(rows * stride), self._buffer(rows * stride)
            self._view(stride)
            for layer in range(self.shape[0]):  # separate buffers: no temporary
                self.k[layer, :live, :, :keep] = old_k[layer, :live, :, :keep]
                self.v[layer, :live, :, :keep] = old_v[layer, :live, :, :keep]
        else:
            self._view(stride)
            if live and keep and stride != old_stride:  # the same buffer: through one layer's copy
                for layer in range(self.shape[0]):
                    k, v = old_k[layer, :live, :, :keep].clone(), old_v[layer, :live, :, :keep].clone()
                    self.k[layer, :live, :, :keep] = k
                    self.v[layer, :live, :, :keep] = v
        self.relayouts += bool(live and keep and stride != old_stride)

    def release(self) -> None:
        """Free a CPU cache's memory (the engine is idle); a fixed CUDA cache stays."""
        if self.growable:
            self._k, self._v = self._buffer(0), self._buffer(0)
            self._view(0)

    def copy_rows(self, dst: torch.Tensor, source: KVCache, src: torch.Tensor, tokens: int) -> None:
        """Slots `dst` [n] take the first `tokens` positions of `source`'s slots `src` [n]. One
        layer at a time, so the gathered temporary is n slots of one layer."""
        for layer in range(self.shape[0]):
            self.k[layer, dst, :, :tokens] = source.k[layer, src, :, :tokens]
            self.v[layer, dst, :, :tokens] = source.v[layer, src, :, :tokens]
        if source is self:
            self.rows_moved += len(dst)

    def load_prefix(self, row: int, prefix: PrefixKV, length: int) -> None:
        keys, values = prefix
        self.k[:, row, :, :length] = keys[:, :, :length]
        self.v[:, row, :, :length] = values[:, :, :length]

    def export(self, row: int, length: int) -> PrefixKV:
        """One slot's first `length` positions (a prefix-cache entry): a copy, or, when this
        cache holds just that one prompt (a prefill workspace), a view of it."""
        keys, values = self.k[:, row, :, :length], self.v[:, row, :, :length]
        if self.rows == 1 and self.tokens == length and self._k.shape[1] == keys[0].numel():
            return keys, values
        return keys.clone(), values.clone()
