"""Tensor work through transformers' own forward, for architectures `decoder.py` does not cover.

The running batch keeps one transformers cache whose rows are left-padded to a common width,
with the matching attention mask; rows join (padded to the width) and leave between steps
(`hf_cache.py` cuts every kind of cache layer into rows: keys and values, recurrent states).
Positions are per row, so padding never shifts a token's position. Adapters are applied by
peft (`AdapterSet.activate`: merged weights for live-only batches, `adapter_names` otherwise;
one pass per adapter where LoRA sits on expert parameters).
A `Runner` (`art.engine.runner`) as `static_runner.StaticRunner` is; no CUDA graphs and no static
shapes here.

On CUDA the batch is bounded by memory as the static runner's is (`memory.py`): every row is as
wide as the widest (left padding), and a growing layer may hold up to twice that, so the
scheduler admits rows while rows x 2 x longest fits in the positions the engine's share leaves
after the weights, the merged-adapter copy and a reserve for prefill (whose attention mask
transformers builds in full).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from art.engine.adapters import AdapterSet, adapted_weight
from art.engine.config import EngineConfig
from art.engine.hf_cache import LayerRows, concat, new_cache, pad_left, read, write
from art.engine.memory import kv_budget, memory_error
from art.engine.prefix_cache import KV, StateAtEnd
from art.engine.runner import Runner
from art.runtime.architectures import has_recurrent_layers
from art.weights import base_of


@dataclass
class StagedRows:
    """Prompts computed by a prefill, left-padded to one width: each layer's cache as rows
    (`LayerRows`), and the padding mask [prompts, width] (0 where a row holds no token)."""

    parts: list[LayerRows]
    mask: torch.Tensor


class HFRunner(Runner[StagedRows]):
    """Implements `art.engine.runner.Runner` through transformers' forward."""

    kv_positions = 0
    """CUDA: the KV positions the engine's share of the GPU holds (the scheduler's budget); 0 on the CPU."""

    def __init__(self, model, adapters: AdapterSet, config: EngineConfig, max_model_len: int) -> None:
        self.model = model
        self.adapters = adapters
        self.model_config = model.config
        self.device = torch.device(config.device)
        self.max_rows = config.resolved_max_num_seqs
        self.max_model_len = max_model_len
        if config.on_cuda:
            self.kv_positions = self._cuda_positions(model, config)
        if config.merge_lora is False:  # None keeps AdapterSet's merge (its copy is in the CUDA budget)
            adapters.merge_live = False
        self.batch = RunningBatch(model.config, self.device)
        self._recurrent = has_recurrent_layers(model.config)
        self.prefill_computed_tokens = 0
        """Prompt tokens actually run through the model (the rest came from cached prefixes)."""
        base = base_of(model)
        # transformers 5.x renamed `past_key_values` to `cache`; accept both.
        self.cache_kw = "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"

    @property
    def row_width(self) -> Callable[[int], int] | None:
        """CUDA: a row of final length n holds up to 2n positions (see the module docstring)."""
        return (lambda length: 2 * length) if self.kv_positions else None

    def _cuda_positions(self, model, config: EngineConfig) -> int:
        heads, dim = kv_heads_and_dim(model.config)
        element = config.torch_dtype.itemsize
        per_position = 2 * model.config.num_hidden_layers * heads * dim * element
        hidden, vocab = model.config.hidden_size, model.config.vocab_size
        inner = getattr(model.config, "intermediate_size", 4 * hidden)
        block = max(config.prefill_tokens, self.max_model_len)  # a long prompt is prefilled whole here
        reserve = (
            block * (12 * hidden + 4 * inner) * element
            + block * self.max_model_len * element
            + block * per_position
            + config.prefix_cache_tokens * per_position
            + 6 * config.resolved_max_num_seqs * vocab * 4
        )
        adapted = sum(adapted_weight(m).numel() for m in model.modules() if hasattr(m, "lora_A"))
        budget = kv_budget(
            config, model, bytes_per_position=per_position, reserve=reserve, copies=adapted * element
        )  # AdapterSet's merged copy
        if budget.positions < 2 * self.max_model_len:
            raise memory_error(
                f"the KV cache does not fit: {budget.describe()}, which leaves {budget.positions} "
                f"positions, fewer than one sequence of max_model_len={self.max_model_len} needs"
            )
        return budget.positions

    def _forward(self, ids, mask, positions, cache, adapter_names: list[str]) -> torch.Tensor:
        """Logits at the last position of each row: [rows, vocab] float32. Rows whose adapters
        cannot share a pass (LoRA on expert parameters) run in one pass per adapter."""
        if self.adapters.mixes_in_one_pass or len(set(adapter_names)) == 1:
            return self._pass(ids, mask, positions, cache, adapter_names)
        before = read(cache)
        width = mask.shape[1] - ids.shape[1]
        logits: torch.Tensor | None = None
        order, after = [], []
        for name in dict.fromkeys(adapter_names):
            rows = [i for i, n in enumerate(adapter_names) if n == name]
            index = torch.tensor(rows, device=self.device)
            sub = new_cache(self.model_config)
            write(sub, [part.select(index) for part in before], width)
            out = self._pass(ids[index], mask[index], positions[index], sub, [name] * len(rows))
            if logits is None:
                logits = out.new_empty(len(adapter_names), out.shape[1])
            logits[index] = out
            order += rows
            after.append(read(sub))
        inverse = torch.argsort(torch.tensor(order, device=self.device))
        write(cache, [concat(list(layer)).select(inverse) for layer in zip(*after)], mask.shape[1])
        assert logits is not None
        return logits

    def _pass(self, ids, mask, positions, cache, adapter_names: list[str]) -> torch.Tensor:
        with self.adapters.activate(adapter_names) as extra:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kw: cache},
                **extra,
            )
        return out.logits[:, -1, :].float()

    def prefill(
        self, prompts: list[list[int]], prefixes: list[tuple[int, KV | None]], adapter_names: list[str]
    ) -> tuple[torch.Tensor, StagedRows]:
        """Run several prompts, each after its cached prefix: (last logits [rows, vocab], the staged prompts).

        Every row's tokens are contiguous and end at the last column: row i's cache holds
        [pad][prefix_i] and its input [rest_i] (or [pad][prompt_i] without a prefix), all inputs
        equally long. Keys and values serve any prefix length, so in one pass a prefix is used only
        as far as that allows: a row whose rest is shorter than the longest recomputes part of its
        prefix, in columns that would otherwise be padding. A recurrent state serves only its whole
        prompt, and padding after it would move it, so rows with one go in passes by rest length.
        The mask hides the pads and positions are per row, so every row computes exactly what it
        would alone, sliding windows included."""
        if not self._recurrent:
            rest = max(len(p) - (min(n, len(p) - 1) if kv is not None else 0) for p, (n, kv) in zip(prompts, prefixes))
            used = [max(0, len(p) - rest) if kv is not None else 0 for p, (_, kv) in zip(prompts, prefixes)]
            return self._prefill_pass(prompts, used, self._kv_rows(prefixes, used), adapter_names)
        groups: dict[int | None, list[int]] = {}
        for i, (prompt, (n, state)) in enumerate(zip(prompts, prefixes)):
            groups.setdefault(len(prompt) - n if isinstance(state, StateAtEnd) else None, []).append(i)
        passes = []
        for rest_length, rows in groups.items():
            used = [prefixes[i][0] if rest_length is not None else 0 for i in rows]
            cached = [state.rows for i in rows if isinstance(state := prefixes[i][1], StateAtEnd)]
            states = [concat(list(layer)) for layer in zip(*cached)] if rest_length is not None else None
            names = [adapter_names[i] for i in rows]
            passes.append((rows, self._prefill_pass([prompts[i] for i in rows], used, states, names)))
        return _joined(passes, len(prompts))

    def _prefill_pass(
        self, prompts: list[list[int]], used: list[int], prefix_rows: list[LayerRows] | None, adapter_names: list[str]
    ) -> tuple[torch.Tensor, StagedRows]:
        """One forward pass of `prompts`, row i after its first `used[i]` tokens' cache
        (`prefix_rows`, left-padded to the longest), ending together at the last column."""
        rest = max(len(p) - n for p, n in zip(prompts, used))
        width_prefix = max(used)
        rows = len(prompts)
        device = self.device
        self.prefill_computed_tokens += sum(len(p) - n for p, n in zip(prompts, used))
        ids = torch.zeros(rows, rest, dtype=torch.long, device=device)  # [rows, rest]
        positions = torch.zeros(rows, rest, dtype=torch.long, device=device)
        mask = torch.zeros(rows, width_prefix + rest, dtype=torch.long, device=device)  # [rows, width]
        for i, (prompt, n) in enumerate(zip(prompts, used)):
            tail = prompt[n:]
            ids[i, rest - len(tail) :] = torch.tensor(tail, device=device)
            positions[i, rest - len(tail) :] = torch.arange(n, len(prompt), device=device)
            mask[i, width_prefix + rest - len(prompt) :] = 1
        cache = new_cache(self.model_config)
        if width_prefix and prefix_rows is not None:
            write(cache, prefix_rows, width_prefix)
        logits = self._forward(ids, mask, positions, cache, adapter_names)
        return logits, StagedRows(read(cache), mask)

    @staticmethod
    def _kv_rows(prefixes: list[tuple[int, KV | None]], used: list[int]) -> list[LayerRows] | None:
        """Each layer's cached prefixes (keys and values) as rows [prompts, heads, width, dim],
        left-padded (a prompt without one: all padding, shaped like the others: MLA's keys and
        values differ). None when no prompt uses one."""
        given = [(kv, n) for (_, kv), n in zip(prefixes, used) if isinstance(kv, tuple) and n]
        if not given:
            return None
        (keys, values), _ = given[0]
        width = max(used)
        parts = []
        for layer in range(keys.shape[0]):
            ks, vs = [], []
            for (_, kv), n in zip(prefixes, used):
                if isinstance(kv, tuple) and n:
                    k, v = kv[0][layer, None, :, :n], kv[1][layer, None, :, :n]
                else:
                    k, v = keys[layer, None, :, :0], values[layer, None, :, :0]
                ks.append(pad_left(k, width))
                vs.append(pad_left(v, width))
            parts.append(LayerRows(torch.cat(ks), torch.cat(vs)))
        return parts

    @property
    def prefixes_whole(self) -> bool:
        """A cached prompt serves only as a whole (its recurrent state is the one its end left)."""
        return self._recurrent

    def prompt_kv(self, staged: StagedRows, index: int) -> KV:
        """Staged prompt `index`'s cache without its padding: keys and values, or on a model with
        recurrent layers every layer's part of that row (`StateAtEnd`)."""
        columns = staged.mask[index].nonzero().squeeze(1)
        one = torch.tensor([index], device=self.device)
        if self._recurrent:
            return StateAtEnd([_drop_columns(part.select(one), columns) for part in staged.parts])
        keys = [part.keys for part in staged.parts]
        values = [part.values for part in staged.parts]
        if any(k is None for k in keys) or any(v is None for v in values):
            raise RuntimeError("a layer keeps no keys and values: its prefix is a StateAtEnd")
        return (
            torch.stack([k[index][:, columns] for k in keys if k is not None]),
            torch.stack([v[index][:, columns] for v in values if v is not None]),
        )

    def add(self, staged: StagedRows, sources: list[int], ends: list[int] | None = None) -> None:
        index = torch.tensor(sources, device=self.device)
        self.batch.add([part.select(index) for part in staged.parts], staged.mask[index])

    def decode(self, tokens: list[int], positions: list[int], adapter_names: list[str]) -> torch.Tensor:
        ids = torch.tensor(tokens, device=self.device)[:, None]  # [rows, 1]
        where = torch.tensor(positions, device=self.device)[:, None]
        mask = self.batch.extend_mask()
        return self._forward(ids, mask, where, self.batch.cache, adapter_names)

    def keep(self, keep: list[int]) -> None:
        self.batch.keep(keep)

    def clear(self) -> None:
        self.batch = RunningBatch(self.model_config, self.device)

    def idle(self) -> None:
        """Nothing to free: an empty batch holds no cache."""

    serves_while_training = False
    """transformers' forward reads the trained modules themselves: a training step pauses it."""

    def weights_changed(self, *, all_weights: bool, retire: str | None = None) -> None:
        """peft's modules are the weights here; `AdapterSet.unmerge` already dropped any merge."""
        if retire is not None:
            raise RuntimeError("transformers' forward serves only the weights in the modules: pause before an update")

    def refresh(self) -> None:
        """Nothing is copied from the modules here."""

    def retired(self) -> set[str]:
        return set()

    def forget(self, name: str) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


class RunningBatch:
    """The cache and padding mask of the rows being decoded together."""

    def __init__(self, config, device: torch.device) -> None:
        self.model_config = config
        self.device = device
        self.rows = 0
        self.cache = new_cache(config)
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [rows, width]

    def add(self, parts: list[LayerRows], mask: torch.Tensor) -> None:
        """Append rows whose cache is `parts` (one per layer) with their padding mask [rows, tokens]."""
        width = max(self.mask.shape[1], mask.shape[1])
        if self.rows:
            parts = [concat([old, new]) for old, new in zip(read(self.cache), parts)]
            mask = torch.cat([_pad_mask(self.mask, width), _pad_mask(mask, width)])
        write(self.cache, parts, width)
        self.mask = mask
        self.rows = mask.shape[0]

    def keep(self, keep: list[int]) -> None:
        """Keep only these row indices; drop columns no remaining row attends to."""
        self.rows = len(keep)
        if not self.rows:
            self.cache = new_cache(self.model_config)
            self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            return
        index = torch.tensor(keep, device=self.device)
        first = int(self.mask[index].any(0).long().argmax())  # leading all-padding columns
        self.mask = self.mask[index, first:]
        parts = [part.select(index) for part in read(self.cache)]
        write(self.cache, [_drop_columns(part, first) for part in parts], self.mask.shape[1])

    def extend_mask(self) -> torch.Tensor:
        """The mask [rows, width + 1] of one decode step: every row sees its new token."""
        self.mask = torch.cat([self.mask, torch.ones(self.rows, 1, dtype=torch.long, device=self.device)], dim=1)
        return self.mask


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A padding mask [rows, tokens] left-padded with zeros to `width` columns."""
    return F.pad(mask, (width - mask.shape[1], 0))


def _drop_columns(part: LayerRows, keep: int | torch.Tensor) -> LayerRows:
    """Keys and values from column `keep` on (or at the columns it lists); states as they are."""
    if part.keys is None or part.values is None or (isinstance(keep, int) and not keep):
        return part
    columns = slice(keep, None) if isinstance(keep, int) else keep
    return LayerRows(part.keys[:, :, columns], part.values[:, :, columns], part.conv, part.recurrent)


def _joined(
    passes: list[tuple[list[int], tuple[torch.Tensor, StagedRows]]], rows: int
) -> tuple[torch.Tensor, StagedRows]:
    """Prefill passes over subsets of the prompts (`passes`: row indices, their (logits, staged
    rows)) as one: in the prompts' order, masks left-padded to the widest."""
    if len(passes) == 1 and passes[0][0] == list(range(rows)):
        return passes[0][1]
    first_mask = passes[0][1][1].mask
    order = torch.tensor([i for indices, _ in passes for i in indices], device=first_mask.device)
    inverse = torch.argsort(order)
    width = max(staged.mask.shape[1] for _, (_, staged) in passes)
    logits = torch.cat([out for _, (out, _) in passes])[inverse]
    mask = torch.cat([_pad_mask(staged.mask, width) for _, (_, staged) in passes])[inverse]
    layers = zip(*(staged.parts for _, (_, staged) in passes))
    return logits, StagedRows([concat(list(layer)).select(inverse) for layer in layers], mask)


def kv_heads_and_dim(config) -> tuple[int, int]:
    """(key/value heads, head dim) of one layer's cache."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, head_dim
