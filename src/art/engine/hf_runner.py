"""Tensor work through transformers' own forward, for architectures `decoder.py` does not cover.

The running batch keeps one transformers cache whose rows are left-padded to a common width,
with the matching attention mask; rows join (padded to the width) and leave between steps.
Positions are per row, so padding never shifts a token's position. Adapters are applied by
peft (`AdapterSet.activate`: merged weights for live-only batches, `adapter_names` otherwise).
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
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from art.engine.adapters import AdapterSet
from art.engine.config import EngineConfig
from art.engine.kv_cache import PrefixKV
from art.engine.memory import kv_budget, memory_error
from art.engine.runner import Runner
from art.weights import base_of


@dataclass
class StagedPaddedKV:
    """Prompts computed by a prefill, left-padded to one width: kv per layer [prompts, heads,
    width, dim] with holes where `mask` [prompts, width] is 0."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor


class HFRunner(Runner[StagedPaddedKV]):
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
        self.batch = RunningBatch(model.config, self.device)
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
        adapted = sum(m.get_base_layer().weight.numel() for m in model.modules() if hasattr(m, "lora_A"))
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
        """Logits at the last position of each row: [rows, vocab] float32."""
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
        self, prompts: list[list[int]], prefixes: list[tuple[int, PrefixKV | None]], adapter_names: list[str]
    ) -> tuple[torch.Tensor, StagedPaddedKV]:
        """Run several prompts, each after its cached prefix, in one forward pass.

        Row i's cache holds [pad][prefix_i] and its input [pad][rest of prompt_i]; the mask
        hides both pads and positions are per row, so every row computes exactly what it would
        alone. Returns (last logits [rows, vocab], the staged prompts).
        """
        used = [min(n, len(p) - 1) if kv is not None else 0 for p, (n, kv) in zip(prompts, prefixes)]
        width_prefix = max(used)
        width_new = max(len(p) - n for p, n in zip(prompts, used))
        rows = len(prompts)
        device = self.device
        self.prefill_computed_tokens += sum(len(p) - n for p, n in zip(prompts, used))
        ids = torch.zeros(rows, width_new, dtype=torch.long, device=device)  # [rows, new]
        positions = torch.zeros(rows, width_new, dtype=torch.long, device=device)
        mask = torch.zeros(rows, width_prefix + width_new, dtype=torch.long, device=device)  # [rows, width]
        for i, (prompt, n) in enumerate(zip(prompts, used)):
            rest = prompt[n:]
            ids[i, width_new - len(rest) :] = torch.tensor(rest, device=device)
            positions[i, width_new - len(rest) :] = torch.arange(n, len(prompt), device=device)
            mask[i, width_prefix - n : width_prefix] = 1
            mask[i, width_prefix + width_new - len(rest) :] = 1
        cache = DynamicCache(config=self.model_config)
        if width_prefix:
            layers = []
            heads, dim = kv_heads_and_dim(self.model_config)
            dtype = next(self.model.parameters()).dtype
            for layer in range(self.model_config.num_hidden_layers):
                ks, vs = [], []
                for (_, kv), n in zip(prefixes, used):
                    if kv is not None and n:
                        k, v = kv[0][layer, None, :, :n], kv[1][layer, None, :, :n]
                    else:  # no cached prefix: all padding
                        k = v = torch.zeros(1, heads, 0, dim, dtype=dtype, device=device)
                    ks.append(_pad_left(k, width_prefix))
                    vs.append(_pad_left(v, width_prefix))
                layers.append((torch.cat(ks), torch.cat(vs)))
            cache = DynamicCache(ddp_cache_data=layers, config=self.model_config)
        logits = self._forward(ids, mask, positions, cache, adapter_names)
        return logits, StagedPaddedKV([_kv(layer) for layer in cache.layers], mask)

    def prompt_kv(self, staged: StagedPaddedKV, index: int) -> PrefixKV:
        columns = staged.mask[index].nonzero().squeeze(1)  # this prompt's kv without padding
        return (
            torch.stack([k[index][:, columns] for k, _ in staged.kv]),
            torch.stack([v[index][:, columns] for _, v in staged.kv]),
        )

    def add(self, staged: StagedPaddedKV, sources: list[int], ends: list[int] | None = None) -> None:
        index = torch.tensor(sources, device=self.device)
        self.batch.add(len(sources), [(k[index], v[index]) for k, v in staged.kv], staged.mask[index])

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


class GrowingLayer(DynamicLayer):
    """A cache layer that appends into spare capacity instead of re-allocating every step.

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
        self._v = v = values.new_empty(rows, heads, tokens + headroom, dim)
        k[:, :, :tokens] = keys
        v[:, :, :tokens] = values
        self._len = tokens
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = k[:, :, :tokens], v[:, :, :tokens]

    def update(self, key_states, value_states, *args, **kwargs):
        if self._k is None:
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


def _growing_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):  # full attention only
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


class RunningBatch:
    """KV and mask of the rows being decoded together."""

    def __init__(self, config, device: torch.device) -> None:
        self.model_config = config
        self.device = device
        self.rows = 0
        self.cache = _growing_cache(config)
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [rows, width]

    def add(self, rows: int, kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Append `rows` rows whose cache is `kv` (per layer [rows, heads, tokens, dim]) with
        their attention mask [rows, tokens] (0 where the kv holds padding)."""
        new_width = kv[0][0].shape[2]
        width = max(self.mask.shape[1], new_width)
        new_mask = mask
        for layer, (k, v) in zip(self.cache.layers, kv):
            if self.rows:
                keys, values = _kv(layer)
                k = torch.cat([_pad_left(keys, width), _pad_left(k, width)])
                v = torch.cat([_pad_left(values, width), _pad_left(v, width)])
            _set(layer, k, v)
        if self.rows:
            new_mask = torch.cat(
                [F.pad(self.mask, (width - self.mask.shape[1], 0)), F.pad(new_mask, (width - new_width, 0))]
            )
        self.mask = new_mask
        self.rows += rows

    def keep(self, keep: list[int]) -> None:
        """Keep only these row indices; drop columns no remaining row attends to."""
        self.rows = len(keep)
        if not self.rows:
            self.cache = _growing_cache(self.model_config)
            self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            return
        index = torch.tensor(keep, device=self.device)
        first = int(self.mask[index].any(0).long().argmax())  # leading all-padding columns
        self.mask = self.mask[index, first:]
        for layer in self.cache.layers:
            keys, values = _kv(layer)
            _set(layer, keys[index, :, first:], values[index, :, first:])

    def extend_mask(self) -> torch.Tensor:
        """The mask [rows, width + 1] of one decode step: every row sees its new token."""
        self.mask = torch.cat([self.mask, torch.ones(self.rows, 1, dtype=torch.long, device=self.device)], dim=1)
        return self.mask


def _kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values [rows, heads, tokens, dim]: an attention layer holds
    both once a forward pass has filled it."""
    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise RuntimeError(f"a {type(layer).__name__} cache layer holds no keys and values to batch")
    return layer.keys, layer.values


def _set(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(layer, GrowingLayer):
        layer.set(keys, values)
    else:
        layer.keys, layer.values = keys.contiguous(), values.contiguous()
        layer.is_initialized, layer.device = True, keys.device


def kv_heads_and_dim(config) -> tuple[int, int]:
    """(key/value heads, head dim) of one layer's cache."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, head_dim


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[2] == width else F.pad(t, (0, 0, width - t.shape[2], 0))
