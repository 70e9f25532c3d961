"""KV of recent prompts, reused by later prompts that share a prefix with them.

A GRPO group sent as separate requests, or many requests behind one long system prompt and
tool list, then prefill only what differs. Entries are keyed by the weights that computed
them and bounded by a token budget (least recently used go first).
"""

from __future__ import annotations

from collections import OrderedDict

from art.engine.kv_cache import PrefixKV as KV  # keys, values [layers, kv_heads, tokens, head_dim]


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], KV] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def longest(self, weights: str, prompt: list[int]) -> tuple[int, KV | None]:
        """(length, kv) of the longest cached prefix of `prompt` computed with `weights`."""
        best_len, best_key = 0, None
        for key in self._entries:
            if key[0] != weights:
                continue
            n = _common(key[1], prompt)
            if n > best_len:
                best_len, best_key = n, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best_len
        keys, values = self._entries[best_key]
        return best_len, (keys[:, :, :best_len], values[:, :, :best_len])

    def put(self, weights: str, prompt: list[int], kv: KV) -> None:
        if len(prompt) > self.max_tokens:
            return
        key = (weights, tuple(prompt))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        # An entry that is a prefix of this one is now redundant.
        for old in [k for k in self._entries if k[0] == weights and prompt[: len(k[1])] == list(k[1])]:
            self._remove(old)
        self._entries[key] = kv
        self._tokens += len(prompt)
        while self._tokens > self.max_tokens:
            self._remove(next(iter(self._entries)))

    def drop(self, weights: str) -> None:
        """Forget everything computed with `weights` (they changed)."""
        for key in [k for k in self._entries if k[0] == weights]:
            self._remove(key)

    def _remove(self, key) -> None:
        del self._entries[key]
        self._tokens -= len(key[1])


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
