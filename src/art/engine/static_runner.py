"""Tensor work of the engine on its own decoder: prefill prompts, decode a step, move rows.

Row i of the running batch is slot i of one KV cache (`kv_cache.py`). A prefill computes a few
prompts (each after its cached prefix) in a workspace cache, in blocks of at most
`prefill_tokens` query tokens, so a long prompt costs a bounded amount of memory; their samples
then join the batch as copies of those prompt rows, so a prompt is computed once for all its
samples. A decode step feeds each row's last token at its own position and attends over a
width that covers every row, rounded up; on CUDA the cache is laid out with that width as its
stride, the rows are padded to a bucket size and the step replays a CUDA graph captured for
that (bucket, width). When samples finish, the engine moves the last rows into their slots
(`keep`).

On CUDA the cache is one buffer of positions sized from `gpu_memory_utilization`
(`memory.py`), not `max_num_seqs` slots of `max_model_len`: a batch of short rows gets many
slots, a long one few. The scheduler admits rows while rows x width(longest row at its end)
fits (`row_width`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from art.engine.adapters import LIVE, AdapterSet
from art.engine.config import EngineConfig
from art.engine.cuda_graphs import DecodeGraphs
from art.engine.decoder import Decoder
from art.engine.kv_cache import KVCache, PrefixKV
from art.engine.memory import kv_budget, memory_error
from art.engine.prefix_cache import KV
from art.engine.runner import Runner
from art.engine.served_weights import ServedWeights

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
CUDA_MIN_WIDTH = 256
"""Attention widths on CUDA are powers of two from here: a few graphs per bucket."""
CPU_WIDTH_STEP = 64
CAUSAL_BEHIND = 0.5
"""A prefill block is causal (no mask) while what lies behind it is at most this many times its
length: measured on the CPU's flash kernel, the causal kernel with zero queries for what is
behind takes 0.5x the masked one at 1% behind, 1.1x at as much behind as the block, 1.7-2x at
2-3x (benchmarks/results/2026-12-02-long_prompt.md)."""
WIDTH_MULTIPLE = 16
"""Widths (and so masks' last dimension) are multiples of this, as SDPA's fused kernels want."""


@dataclass
class StagedWorkspace:
    """Prompts computed by a prefill, in a workspace cache (row i = prompt i, `lengths[i]` long)."""

    cache: KVCache
    lengths: list[int]


class StaticRunner(Runner[StagedWorkspace]):
    """Implements `art.engine.runner.Runner` on the engine's own decoder."""

    def __init__(self, model, adapters: AdapterSet, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.pad = config.pad_batches if config.pad_batches is not None else config.on_cuda
        merge = config.merge_lora if config.merge_lora is not None else not config.on_cuda
        self.weights = ServedWeights(model, dtype=config.torch_dtype, merge=merge, pack=not config.on_cuda)
        adapters.merge_live = False  # the engine never merges into the shared modules: `weights` keeps its own copy
        self.max_model_len = max_model_len
        self.max_width = -(-max_model_len // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        # Padding tokens of a prefill may run past the longest prompt: room for twice the length.
        self.fixed = config.fixed_kv_layout
        """CUDA's layout (on the CPU too under kv_layout="fixed"): one buffer, the width as stride."""
        self.decoder = Decoder(
            model,
            self.weights,
            max_positions=2 * self.max_width,
            device=self.device,
            dtype=config.torch_dtype,
            repeat_kv=self.fixed,
        )
        self.lengths: list[int] = []
        """Tokens in each running row's slot."""
        self.ends: list[int] = []
        """The length each running row may reach (prompt + max_tokens): how far a CPU cache grows."""
        self.graphs: DecodeGraphs | None = None
        if self.fixed:
            self.cache = self._fixed_cache(model)
            self.max_rows = self.cache.slots_at(CUDA_MIN_WIDTH)
            if config.on_cuda and not config.enforce_eager:
                self.graphs = DecodeGraphs(self.decoder, self.cache, self.max_rows)
                self._capture_at_start(self.graphs)
        else:
            self.max_rows = config.resolved_max_num_seqs
            self.cache = self.decoder.kv_cache(max_rows=self.max_rows, max_tokens=self.max_width, growable=True)
        self.prefill_computed_tokens = 0
        """Prompt tokens actually run through the model (the rest came from cached prefixes)."""

    @property
    def row_width(self) -> Callable[[int], int] | None:
        """For the scheduler on CUDA: the width a row of a given final length holds (every slot has
        the stride of the widest row). None on the CPU, where the budget is a sum of lengths."""
        return self._width if self.fixed else None

    @property
    def kv_positions(self) -> int:
        return self.cache.capacity

    # -- prefill ------------------------------------------------------------------------------
    def prefill(
        self, prompts: list[list[int]], prefixes: list[tuple[int, KV | None]], adapter_names: list[str]
    ) -> tuple[torch.Tensor, StagedWorkspace]:
        """Run prompts (row i after its cached prefix): (logits [prompts, vocab], staged).

        In blocks of at most `prefill_tokens` query tokens: each block writes its keys and values
        into the workspace and attends over what the earlier blocks wrote, so a prompt of any
        length needs one block's activations and mask. When every row has the same cached
        prefix (none, or a shared system prompt) a block is causal and needs no mask at all,
        unless what lies behind it is long next to the block (see `Decoder._attend`)."""
        self.weights.refresh()
        used = [min(n, len(p) - 1) if kv is not None else 0 for p, (n, kv) in zip(prompts, prefixes)]
        rests = [p[n:] for p, n in zip(prompts, used)]
        rows, tokens, offset = len(prompts), max(map(len, rests)), max(used)
        workspace = self.decoder.kv_cache(max_rows=rows, max_tokens=offset + tokens, growable=False)
        for i, ((_, kv), n) in enumerate(zip(prefixes, used)):
            if isinstance(kv, tuple) and n:  # keys and values: this decoder's layers keep nothing else
                workspace.load_prefix(i, kv, n)
        ids = torch.tensor([rest + [0] * (tokens - len(rest)) for rest in rests], device=self.device)
        positions = torch.tensor(used, device=self.device)[:, None] + torch.arange(tokens, device=self.device)
        last = [len(rest) - 1 for rest in rests]
        route = self.weights.route(adapter_names, self.device)
        logits = torch.empty(rows, self.decoder.config.vocab_size, dtype=torch.float32, device=self.device)
        block = max(1, self.config.prefill_tokens // rows)
        for start in range(0, tokens, block):
            end = min(tokens, start + block)
            at = torch.tensor([min(max(n - start, 0), end - start - 1) for n in last], device=self.device)
            behind = offset + start  # positions every row has before this block, when all have the same
            causal = len(set(used)) == 1 and behind <= CAUSAL_BEHIND * (end - start)
            out = self.decoder.forward(
                ids[:, start:end],
                positions[:, start:end],
                workspace,
                offset + end,
                route,
                last=at,
                after=behind if causal else None,
            )
            here = [r for r, n in enumerate(last) if start <= n < end]  # rows whose last token is in this block
            if here:
                index = torch.tensor(here, device=self.device)
                logits[index] = out[index]
        self.prefill_computed_tokens += sum(map(len, rests))
        return logits, StagedWorkspace(workspace, [len(p) for p in prompts])

    def prompt_kv(self, staged: StagedWorkspace, index: int) -> PrefixKV:
        return staged.cache.export(index, staged.lengths[index])

    def add(self, staged: StagedWorkspace, sources: list[int], ends: list[int] | None = None) -> None:
        """Append one row per entry of `sources`, a copy of staged prompt `sources[k]`; `ends[k]`
        is the length that row may reach (default: max_model_len)."""
        start = len(self.lengths)
        tokens = max(staged.lengths[s] for s in sources)
        self.ends += ends or [self.max_model_len] * len(sources)
        self._arrange(start + len(sources), self._width(tokens + 1))
        dst = torch.arange(start, start + len(sources), device=self.device)
        self.cache.copy_rows(dst, staged.cache, torch.tensor(sources, device=self.device), tokens)
        self.lengths += [staged.lengths[s] for s in sources]

    # -- decode -------------------------------------------------------------------------------
    def decode(self, tokens: list[int], positions: list[int], adapter_names: list[str]) -> torch.Tensor:
        """One token for every running row at its position: logits [rows, vocab]."""
        self.weights.refresh()
        rows = len(tokens)
        width = self._width(max(positions) + 1)
        padded = self._bucket(rows, width) if self.pad else rows
        self._arrange(padded, width)
        fill = padded - rows  # padding rows sit in free slots, at position 0
        ids = torch.tensor(tokens + [0] * fill, device=self.device)[:, None]  # [padded, 1]
        where = torch.tensor(positions + [0] * fill, device=self.device)[:, None]
        route = self.weights.route(adapter_names + [adapter_names[0]] * fill, self.device)
        logits = None
        if self.graphs is not None and route.key is not None:
            logits = self.graphs.run(ids, where, width, route)  # None: this shape has no working graph
        if logits is None:
            logits = self.decoder.forward(ids, where, self.cache, width, route)
        self.lengths = [p + 1 for p in positions]
        return logits[:rows]

    def keep(self, order: list[int]) -> None:
        """Keep the rows `order` names: row order[i] moves into slot i (any order; the engine
        moves the last rows into finished rows' slots, one copy per finished row)."""
        moved = [(i, j) for i, j in enumerate(order) if i != j]
        if moved:
            dst = torch.tensor([i for i, _ in moved], device=self.device)
            src = torch.tensor([j for _, j in moved], device=self.device)
            self.cache.copy_rows(dst, self.cache, src, max(self.lengths[j] for _, j in moved))
        self.lengths = [self.lengths[j] for j in order]
        self.ends = [self.ends[j] for j in order]

    def clear(self) -> None:
        """Forget every row (after a failure); a CPU cache frees its memory."""
        self.lengths, self.ends = [], []
        self.cache.release()

    def idle(self) -> None:
        """No rows are running (e.g. a training step is about to start): free what the CPU can."""
        if not self.lengths:
            self.cache.release()

    prefixes_whole = False
    """Every layer of the decoder's families keeps keys and values only: any prefix serves."""

    serves_while_training = True
    """The decoder reads the live adapter through `ServedWeights`' published copies, never the
    tensors the trainer writes: a training step may run beside it."""

    def weights_changed(self, *, all_weights: bool, retire: str | None = None) -> None:
        self.weights.weights_changed(all_weights=all_weights, retire=retire)

    def refresh(self) -> None:
        """Copy the published weights now (the trainer is about to write the live ones)."""
        self.weights.refresh()

    def retired(self) -> set[str]:
        return self.weights.retired()

    def forget(self, name: str) -> None:
        self.weights.forget(name)

    def stats(self) -> dict[str, float]:
        graphs = (
            self.graphs.stats()
            if self.graphs
            else {"engine/cuda_graphs": 0.0, "engine/graph_replays": 0.0, "engine/graph_failures": 0.0}
        )
        return {
            "engine/kv_slots": float(self.max_rows),
            "engine/kv_positions": float(self.cache.capacity),
            "engine/kv_rows_moved": float(self.cache.rows_moved),
            **graphs,
        }

    # -- sizes --------------------------------------------------------------------------------
    def _bucket(self, rows: int, width: int) -> int:
        limit = self.cache.slots_at(width) if self.fixed else self.max_rows
        return min(next((b for b in ROW_BUCKETS if b >= rows), rows), max(rows, limit))

    def _width(self, needed: int) -> int:
        if self.fixed:
            width = CUDA_MIN_WIDTH
            while width < needed:
                width *= 2
        else:
            width = -(-needed // CPU_WIDTH_STEP) * CPU_WIDTH_STEP
        return min(width, self.max_width)

    def _arrange(self, rows: int, width: int) -> None:
        """Make the cache hold `rows` slots that cover `width` positions, keeping the live rows.
        On CUDA the stride becomes exactly the width (what a graph for that width reads); a CPU
        cache grows by doubling, no further than its longest row can reach."""
        cache, live, length = self.cache, len(self.lengths), max(self.lengths, default=0)
        if self.fixed:
            cache.arrange(rows, max(width, self._width(length + 1) if live else width), live=live, length=length)
            return
        if rows <= cache.rows and width <= cache.tokens:
            return
        reach = self._width(max(self.ends, default=width))
        stride = cache.tokens if width <= cache.tokens else max(width, min(reach, 2 * max(cache.tokens, width)))
        slots = cache.rows if rows <= cache.rows else max(rows, min(2 * cache.rows, self.max_rows))
        cache.arrange(slots, stride, live=live, length=length)

    def _fixed_cache(self, model) -> KVCache:
        """The KV buffer: on CUDA every position the engine's share of the GPU leaves (`memory.py`)
        after a reserve for what a step allocates beside it; on the CPU what kv_cache_bytes holds."""
        config, decoder = self.config, self.decoder
        if not config.on_cuda:
            per_position = 2 * len(decoder.layers) * decoder.kv_heads * decoder.head_dim * config.torch_dtype.itemsize
            return decoder.kv_cache(
                max_rows=config.resolved_max_num_seqs,
                max_tokens=self.max_width,
                growable=False,
                capacity=max(self.max_width, config.kv_cache_bytes // per_position),
            )
        layers, element = len(decoder.layers), config.torch_dtype.itemsize
        per_position = 2 * layers * decoder.kv_heads * decoder.head_dim * element
        hidden, vocab = decoder.config.hidden_size, decoder.config.vocab_size
        inner = getattr(decoder.config, "intermediate_size", 4 * hidden)
        block = config.prefill_tokens
        reserve = (
            block * (12 * hidden + 4 * inner) * element  # a prefill block's activations
            + block * self.max_width * element  # its mask
            + 2 * decoder.q_heads * self.max_width * decoder.head_dim * element  # keys repeated per head
            + max(block, self.max_width) * per_position  # the workspace: a chunk, or one long prompt
            + config.prefix_cache_tokens * per_position  # the prefix cache
            + 6 * config.resolved_max_num_seqs * vocab * 4
        )  # graph logits, eager logits, sampling
        # A change of layout copies the live rows through one layer's temporary.
        budget = kv_budget(
            config,
            model,
            bytes_per_position=per_position * (layers + 1) // layers,
            reserve=reserve,
            copies=self.weights.copy_bytes(decoder.projections()),
        )
        if budget.positions < self.max_width:
            raise memory_error(
                f"the KV cache does not fit: {budget.describe()}, which leaves "
                f"{budget.positions} positions, fewer than one sequence of "
                f"max_model_len={self.max_model_len}"
            )
        slots = min(config.resolved_max_num_seqs, budget.positions // CUDA_MIN_WIDTH)
        if slots < config.resolved_max_num_seqs:
            log.warning(
                "KV cache: %d rows of %d tokens fit in gpu_memory_utilization=%s (max_num_seqs=%d asked); "
                "raise gpu_memory_utilization for more",
                slots,
                CUDA_MIN_WIDTH,
                config.gpu_memory_utilization,
                config.resolved_max_num_seqs,
            )
        try:
            return decoder.kv_cache(
                max_rows=slots, max_tokens=self.max_width, growable=False, capacity=budget.positions
            )
        except torch.cuda.OutOfMemoryError as exc:
            raise memory_error(f"allocating the KV cache ({budget.positions} positions) ran out of GPU memory") from exc

    def _capture_at_start(self, graphs: DecodeGraphs) -> None:
        """Record what live serving needs first: every bucket at the narrowest width, live weights.
        Wider widths (and the base model's route) are recorded when first needed."""
        width = self._width(1)
        route = self.weights.route([LIVE], self.device)
        self.weights.refresh()  # the live LoRA's copies exist before a graph records their addresses
        buckets = [b for b in ROW_BUCKETS if b <= self.cache.slots_at(width)]
        with torch.inference_mode():
            self.cache.arrange(max(buckets), width, live=0, length=0)
            for rows in reversed(buckets):  # largest first: later ones reuse its pool memory
                graphs.capture(rows, width, route)
