"""Which replica serves a prompt: prefix affinity within a load bound, else the least loaded.

Pure Python over what a replica says of itself (`Replica`: its index, requests in flight, and
why it is down); the replicas themselves are `art.engine.replicas`'s.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from art.errors import BackendUnavailableError

BLOCK = 16
"""Tokens per prefix block the router remembers (a prompt's prefix is matched block by block)."""
BALANCE = 8
"""A replica holding a prompt's prefix still gets it unless it has this many more requests in
flight than the least-loaded replica."""
REMEMBERED_BLOCKS = 65536
"""Prefix blocks the router remembers per replica (least recently used forgotten first)."""
RETRY_AFTER_S = 1


class ReplicaUnavailableError(BackendUnavailableError):
    """A replica stopped while serving a request: the request may be sent again (503)."""

    retry_after = RETRY_AFTER_S


class Replica(Protocol):
    """What a replica says of itself; the router needs `index`, `in_flight` and `down`."""

    index: int
    """Its place in the replica set (0: the backend's own engine)."""
    in_flight: int = 0
    """Requests it is serving now."""
    down: str | None = None
    """Why it is out of the rotation; None while it serves."""

    @property
    def step(self) -> int | None:
        """The training step whose weights the replica holds."""
        ...


R = TypeVar("R", bound=Replica)
"""Whatever kind of replica the caller routes among: `choose` hands back the same kind."""


class PrefixRouter:
    """Chooses a replica for a prompt: prefix affinity within a load bound, else least loaded.

    Each replica remembers the hashes of the prompt prefixes it served, block by block. The
    replica holding the longest prefix of a prompt *beyond what every live replica holds* (the
    system prompt soon sits everywhere) gets it, unless it has `BALANCE` or more requests in
    flight than the least-loaded replica."""

    def __init__(self) -> None:
        self._seen: dict[int, OrderedDict[int, None]] = {}
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[R], prompt: list[int]) -> R:
        live = [r for r in replicas if r.down is None]
        if not live:
            raise ReplicaUnavailableError("no engine replica is serving (see GET /health)")
        blocks = _block_hashes(prompt)
        matched = {r.index: self._matched(r.index, blocks) for r in live}
        shared = min(matched.values())
        least = min(r.in_flight for r in live)
        best = max(live, key=lambda r: (matched[r.index], -r.in_flight))
        if matched[best.index] > shared and best.in_flight < least + BALANCE:
            chosen = best
        else:  # least loaded; ties in turn, so an idle set fills evenly
            idle = [r for r in live if r.in_flight == least]
            chosen = idle[next(self._turn) % len(idle)]
        self._remember(chosen.index, blocks)
        return chosen

    def _matched(self, index: int, blocks: list[int]) -> int:
        seen: Mapping[int, None] = self._seen.get(index, {})
        n = 0
        while n < len(blocks) and blocks[n] in seen:
            n += 1
        return n

    def _remember(self, index: int, blocks: list[int]) -> None:
        seen = self._seen.setdefault(index, OrderedDict())
        for block in blocks:
            seen[block] = None
            seen.move_to_end(block)
        while len(seen) > REMEMBERED_BLOCKS:
            seen.popitem(last=False)

    def forget(self, index: int) -> None:
        """A restarted replica holds no prefixes."""
        self._seen.pop(index, None)


def _block_hashes(prompt: list[int]) -> list[int]:
    """One hash per prefix: of the first BLOCK tokens, the first 2*BLOCK, ..., and the whole prompt."""
    out, running = [], 0
    for start in range(0, len(prompt), BLOCK):
        running = hash((running, tuple(prompt[start : start + BLOCK])))
        out.append(running)
    return out
