"""Lay training sequences out in rows so the trunk computes as few tokens as possible.

A GRPO group's samples share their prompt. With `packing="shared_prefix"` the longest common
prefix of a group's sequences is laid out once and each sequence's remaining tokens follow it
as a branch that attends to the prefix and to itself only (ART's group/parent mask); position
ids restart after the prefix for every branch, so each token sees exactly the context it was
sampled with. Units (a prefix and its branches) are then packed into rows without padding,
and rows into micro-batches. `"packed"` packs whole sequences without sharing; `"padded"` gives
each sequence its own row (the plain layout, kept to check the others against).

Every sequence token gets a slot (row, column). A token is predicted by the hidden state of
the slot of the token before it, so the output head runs only on the positions whose target
is trained, never on prompt positions.

A micro-batch whose rows each hold one sequence (always with "padded") needs no mask: it goes
to the model with none and with positions that run on through the right padding, so
transformers takes SDPA's `is_causal` path (flash kernels on a GPU) and no [rows, W, W] tensor
exists; the padding's outputs are never read. Other micro-batches get an additive
[rows, 1, W, W] mask (`attention_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from art.training.sequences import Sequence

HOST = "cpu"
"""Where batches are assembled from Python lists before one copy to the training device."""


@dataclass
class Unit:
    """A shared prefix (maybe empty) and the sequences continuing it."""

    prefix: list[int]
    sequences: list[Sequence] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.prefix) + sum(len(s.token_ids) - len(self.prefix) for s in self.sequences)


@dataclass
class Row:
    """The token at column c sees columns [unit_start[c], prefix_end[c]) (its unit's shared
    prefix, for a branch token) and [branch_start[c], c] (its own run up to itself)."""

    token_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    unit_start: list[int] = field(default_factory=list)
    prefix_end: list[int] = field(default_factory=list)
    """A prefix token's equals its unit_start (it sees the prefix through its own run)."""
    branch_start: list[int] = field(default_factory=list)
    sequences: int = 0
    """How many sequences the row holds (1: plain causal attention over it is exact)."""


class BatchTensors(NamedTuple):
    """A micro-batch on the training device: packed rows for the trunk, and per-sequence tensors
    for the loss, where position t holds token t+1 (the way `policy_loss_terms` reads them)."""

    ids: torch.Tensor  # [rows, width] token ids, right-padded
    positions: torch.Tensor  # [rows, width] position ids
    sources: tuple[torch.Tensor, torch.Tensor]  # ([trained], [trained]): (row, column) predicting each trained token
    targets: torch.Tensor  # [trained] the trained tokens' ids
    scatter: tuple[torch.Tensor, torch.Tensor]  # ([trained], [trained]): (sequence, position) of each trained token
    mask: torch.Tensor  # [sequences, tokens-1] 1.0 where the token is trained
    sampler: torch.Tensor  # [sequences, tokens-1] the sampler's logprobs, 0 where not trained
    advantages: torch.Tensor  # [sequences]
    attention: torch.Tensor | None  # [rows, 1, width, width] additive mask; None when every row is one sequence


@dataclass
class MicroBatch:
    """Rows for one forward pass and where each of its sequences' tokens sit in them."""

    rows: list[Row]
    sequences: list[Sequence]
    slots: list[list[tuple[int, int]]]
    """slots[i][t]: the (row, column) holding token t of sequences[i]."""

    @property
    def width(self) -> int:
        return max(len(r.token_ids) for r in self.rows)

    @property
    def tokens_computed(self) -> int:
        """Tokens the trunk runs on, padding included."""
        return len(self.rows) * self.width

    @property
    def causal(self) -> bool:
        """Every row is one sequence, so plain causal attention over it is exact."""
        return one_sequence_per_row(self.rows)

    def to_tensors(self, pad_id: int, device: torch.device, dtype: torch.dtype) -> BatchTensors:
        """The batch's tensors on `device` (`BatchTensors`; the attention mask in `dtype`).
        Assembled on the host from Python lists, then copied once. `attention` is None when every
        row holds one sequence (the model's causal path), else the additive 4D mask."""
        ids, positions = row_tensors(self.rows, pad_id)
        length = max(len(s.token_ids) for s in self.sequences) - 1
        mask, sampler = [], []  # [sequences][length]
        out_row, out_col, src_row, src_col, targets = [], [], [], [], []
        for i, (s, slots) in enumerate(zip(self.sequences, self.slots)):
            trained = [t for t in range(1, len(s.token_ids)) if s.trained[t]]
            out_row += [i] * len(trained)
            out_col += [t - 1 for t in trained]
            src_row += [slots[t - 1][0] for t in trained]
            src_col += [slots[t - 1][1] for t in trained]
            targets += [s.token_ids[t] for t in trained]
            padding = [0.0] * (length + 1 - len(s.token_ids))
            mask.append([1.0 if on else 0.0 for on in s.trained[1:]] + padding)
            sampler.append([lp if on else 0.0 for on, lp in zip(s.trained[1:], s.sampler_logprobs[1:])] + padding)

        def on_device(values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=HOST).to(device)

        return BatchTensors(
            ids=ids.to(device),
            positions=positions.to(device),
            sources=(on_device(src_row), on_device(src_col)),
            targets=on_device(targets),
            scatter=(on_device(out_row), on_device(out_col)),
            mask=on_device(mask, torch.float),
            sampler=on_device(sampler, torch.float),
            advantages=on_device([s.advantage for s in self.sequences]),
            # one sequence per row: no mask, so SDPA runs its causal kernels
            attention=None if self.causal else attention_mask(self.rows, ids.shape[1], dtype, device),
        )


def one_sequence_per_row(rows: list[Row]) -> bool:
    return all(row.sequences == 1 for row in rows)


def common_prefix_length(sequences: list[Sequence]) -> int:
    first = sequences[0].token_ids
    length = min(len(s.token_ids) for s in sequences)
    for s in sequences[1:]:
        ids = s.token_ids
        n = 0
        while n < length and ids[n] == first[n]:
            n += 1
        length = n
    return length


def units_of(groups: list[list[Sequence]], mode: str, row_tokens: int) -> list[Unit]:
    """One unit per sequence, or (shared_prefix) per group, split where a unit outgrows a row."""
    if mode != "shared_prefix":
        return [Unit([], [s]) for group in groups for s in group]
    units: list[Unit] = []
    for group in groups:
        if not group:
            continue
        # Keep at least one token per branch: a branch's first token is predicted from the
        # prefix's last slot, and an empty branch would leave nothing to attach to.
        shared = common_prefix_length(group) if len(group) > 1 else 0
        shared = min(shared, min(len(s.token_ids) for s in group) - 1)
        prefix = group[0].token_ids[: max(shared, 0)]
        unit = Unit(prefix)
        for s in group:
            branch = len(s.token_ids) - len(prefix)
            if unit.sequences and unit.size + branch > row_tokens:
                units.append(unit)
                unit = Unit(prefix)
            unit.sequences.append(s)
        units.append(unit)
    return units


def pack(units: list[Unit], mode: str, row_tokens: int) -> list[list[Unit]]:
    """Units per row: first fit by decreasing size ("padded": one unit per row)."""
    if mode == "padded":
        return [[u] for u in units]
    rows: list[list[Unit]] = []
    sizes: list[int] = []
    for unit in sorted(units, key=lambda u: -u.size):
        for i, used in enumerate(sizes):
            if used + unit.size <= row_tokens:
                rows[i].append(unit)
                sizes[i] += unit.size
                break
        else:
            rows.append([unit])
            sizes.append(unit.size)
    return rows


def lay_out(row_units: list[list[Unit]]) -> tuple[list[Row], dict[int, list[tuple[int, int]]]]:
    """Token ids, positions and attention bounds of each row, and every sequence's slots (by id())."""
    rows: list[Row] = []
    slots: dict[int, list[tuple[int, int]]] = {}
    for r, units in enumerate(row_units):
        row = Row()
        for unit in units:
            start = len(row.token_ids)
            n = len(unit.prefix)
            row.token_ids += unit.prefix
            row.position_ids += list(range(n))
            row.unit_start += [start] * n
            row.prefix_end += [start] * n
            row.branch_start += [start] * n
            for s in unit.sequences:
                tail = s.token_ids[n:]
                column = len(row.token_ids)
                row.token_ids += tail
                row.position_ids += list(range(n, n + len(tail)))
                row.unit_start += [start] * len(tail)
                row.prefix_end += [start + n] * len(tail)
                row.branch_start += [column] * len(tail)
                row.sequences += 1
                slots[id(s)] = [(r, start + t) for t in range(n)] + [(r, column + t) for t in range(len(tail))]
        rows.append(row)
    return rows, slots


def plan(groups: list[list[Sequence]], *, mode: str, row_tokens: int, batch_tokens: int) -> list[MicroBatch]:
    """Micro-batches covering every sequence once, each within `batch_tokens` computed tokens
    (rows x widest row) unless a single row is wider."""
    rows, slots = lay_out(pack(units_of(groups, mode, row_tokens), mode, row_tokens))
    members: dict[int, list[Sequence]] = {}
    for group in groups:
        for s in group:
            members.setdefault(slots[id(s)][0][0], []).append(s)
    order = sorted(range(len(rows)), key=lambda r: len(rows[r].token_ids))
    batches: list[list[int]] = []
    for r in order:
        if batches and (len(batches[-1]) + 1) * len(rows[r].token_ids) <= batch_tokens:
            batches[-1].append(r)
        else:
            batches.append([r])
    out = []
    for chosen in batches:
        local = {r: i for i, r in enumerate(chosen)}
        sequences = [s for r in chosen for s in members.get(r, [])]
        out.append(
            MicroBatch(
                rows=[rows[r] for r in chosen],
                sequences=sequences,
                slots=[[(local[r], c) for r, c in slots[id(s)]] for s in sequences],
            )
        )
    return out


def attention_mask(rows: list[Row], width: int, dtype: torch.dtype, device: torch.device | str = HOST) -> torch.Tensor:
    """Additive mask [rows, 1, width, width] on `device`: a token sees earlier tokens of its own
    branch and its unit's prefix. Padding sees only itself, so no softmax row is empty.
    Built from each query's three bounds (`Row`) with one bool [rows, width, width] kept and one
    more alive at a time, besides the mask itself."""

    def bound(values: list[list[int]], padding_sees_itself: bool = True) -> torch.Tensor:  # [rows, width, 1]
        out = [v + (list(range(len(v), width)) if padding_sees_itself else [0] * (width - len(v))) for v in values]
        return torch.tensor(out, device=HOST).to(device)[:, :, None]

    unit_start, branch_start = bound([r.unit_start for r in rows]), bound([r.branch_start for r in rows])
    prefix_end = bound([r.prefix_end for r in rows], padding_sees_itself=False)  # padding has no prefix
    keys = torch.arange(width, device=device)  # [width], broadcast along the key axis
    allowed = keys >= branch_start  # [rows, width, width]: from the query's own run on...
    allowed |= keys < prefix_end  # ...or inside its unit's prefix...
    allowed &= keys >= unit_start  # ...never before its unit...
    allowed.tril_()  # ...and never after the query
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    return mask.masked_fill_(allowed, 0.0)[:, None]


def row_tensors(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and position ids [rows, width], right-padded, on the host (the caller moves them).
    In a causal micro-batch (one sequence per row) the padding's positions continue the row's,
    so the model sees one unbroken sequence per row (transformers reads positions that restart
    as packed sequences and would build a mask for them); elsewhere they are 0."""
    width = max(len(r.token_ids) for r in rows)
    causal = one_sequence_per_row(rows)
    ids = [r.token_ids + [pad_id] * (width - len(r.token_ids)) for r in rows]
    positions = [
        r.position_ids + (list(range(len(r.position_ids), width)) if causal else [0] * (width - len(r.position_ids)))
        for r in rows
    ]
    return torch.tensor(ids, dtype=torch.long, device=HOST), torch.tensor(positions, dtype=torch.long, device=HOST)
