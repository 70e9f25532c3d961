"""Keys and values of a batch: row i of the batch lives in slot i, every layer in one tensor.

Keys and values are each one tensor [layers, slots, kv_heads, tokens, head_dim], so moving a
row is one indexing op over all layers, and a decode step attends over the view
[:rows, :, :width] of a layer: the same memory for the same (rows, width), which is what a
CUDA graph needs. On CUDA the cache is allocated once at full size; on the CPU it grows by
doubling as work needs it and is released when the engine idles. Rows are kept dense: when
samples finish, the rows after them move down (`keep`).

Prefix-cache entries use the same layout without the slot axis: (keys, values), each
[layers, kv_heads, tokens, head_dim].
"""

from __future__ import annotations

import torch

PrefixKV = tuple[torch.Tensor, torch.Tensor]  # keys, values [layers, kv_heads, tokens, head_dim]


class KVCache:
    def __init__(self, *, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 max_rows: int, max_tokens: int, growable: bool) -> None:
        self.shape = (layers, heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.growable = growable
        rows, tokens = (0, 0) if growable else (max_rows, max_tokens)
        self.k = self._empty(rows, tokens)  # [layers, slots, heads, tokens, dim]
        self.v = self._empty(rows, tokens)

    def _empty(self, rows: int, tokens: int) -> torch.Tensor:
        layers, heads, dim = self.shape
        return torch.zeros(layers, rows, heads, tokens, dim, dtype=self.dtype, device=self.device)

    @property
    def rows(self) -> int:
        """Slots allocated now."""
        return self.k.shape[1]

    @property
    def tokens(self) -> int:
        """Positions per slot allocated now."""
        return self.k.shape[3]

    @property
    def bytes_per_token(self) -> int:
        layers, heads, dim = self.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def reserve(self, rows: int, tokens: int) -> None:
        """Make room for `rows` slots of `tokens` positions (grows a CPU cache, keeping its contents)."""
        if rows <= self.rows and tokens <= self.tokens:
            return
        if not self.growable or rows > self.max_rows or tokens > self.max_tokens:
            raise ValueError(f"KV cache of {self.rows} slots x {self.tokens} positions cannot hold "
                             f"{rows} x {tokens}")
        new_rows = min(self.max_rows, max(rows, 2 * self.rows, 4))
        new_tokens = min(self.max_tokens, max(tokens, 2 * self.tokens, 64))
        for name in ("k", "v"):
            old, new = getattr(self, name), self._empty(new_rows, new_tokens)
            new[:, :old.shape[1], :, :old.shape[3]] = old
            setattr(self, name, new)

    def release(self) -> None:
        """Free a CPU cache's memory (the engine is idle); a fixed CUDA cache stays."""
        if self.growable:
            self.k, self.v = self._empty(0, 0), self._empty(0, 0)

    def copy_rows(self, dst: torch.Tensor, source: KVCache, src: torch.Tensor, tokens: int) -> None:
        """Slots `dst` [n] take the first `tokens` positions of `source`'s slots `src` [n]."""
        self.k[:, dst, :, :tokens] = source.k[:, src, :, :tokens]
        self.v[:, dst, :, :tokens] = source.v[:, src, :, :tokens]

    def load_prefix(self, row: int, prefix: PrefixKV, length: int) -> None:
        keys, values = prefix
        self.k[:, row, :, :length] = keys[:, :, :length]
        self.v[:, row, :, :length] = values[:, :, :length]

    def export(self, row: int, length: int) -> PrefixKV:
        """A copy of one slot's first `length` positions (a prefix-cache entry)."""
        return self.k[:, row, :, :length].clone(), self.v[:, row, :, :length].clone()
