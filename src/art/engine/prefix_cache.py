"""KV of recent prompts, reused by later prompts that share a prefix with them.

A GRPO group sent as separate requests, or many requests behind one long system prompt and
tool list, then prefill only what differs. Entries are keyed by the weights that computed
them and bounded by a token budget (least recently used go first).

An entry is keys and values (any prefix of it serves: they are cut to the shared length), or a
`StateAtEnd`: on a model with recurrent layers a prompt's cache holds the state its last token
left, which serves only a prompt that continues the whole of it (the multi-turn agent's next
turn, a group behind one system prompt), never a shorter prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from art.engine.kv_cache import PrefixKV  # keys, values [layers, kv_heads, tokens, head_dim]


@dataclass(frozen=True)
class StateAtEnd:
    """A prompt's cache that serves only as a whole (recurrent states): `rows`, the runner's form."""

    rows: Any


KV = PrefixKV | StateAtEnd


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], KV] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def longest(self, weights: str, prompt: list[int]) -> tuple[int, KV | None]:
        """(length, kv) of the longest cached prefix of `prompt` computed with `weights` (a
        `StateAtEnd` only where `prompt` continues its whole prompt, with at least one token more)."""
        best_len, best_key = 0, None
        for key in self._entries:
            if key[0] != weights:
                continue
            n = _common(key[1], prompt)
            if isinstance(self._entries[key], StateAtEnd) and not len(key[1]) == n < len(prompt):
                continue
            if n > best_len:
                best_len, best_key = n, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best_len
        entry = self._entries[best_key]
        if isinstance(entry, StateAtEnd):
            return best_len, entry
        keys, values = entry
        return best_len, (keys[:, :, :best_len], values[:, :, :best_len])

    def put(self, weights: str, prompt: list[int], kv: KV) -> None:
        if len(prompt) > self.max_tokens:
            return
        key = (weights, tuple(prompt))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        # An entry that is a prefix of this one is now redundant (not a state: it serves its own length).
        for old in [
            k
            for k in self._entries
            if k[0] == weights and prompt[: len(k[1])] == list(k[1]) and not isinstance(self._entries[k], StateAtEnd)
        ]:
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
