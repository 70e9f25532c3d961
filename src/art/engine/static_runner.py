"""Tensor work of the engine on its own decoder: prefill prompts, decode a step, move rows.

Row i of the running batch is slot i of one KV cache (`kv_cache.py`). A prefill computes a few
prompts (each after its cached prefix) in a workspace cache; their samples then join the batch
as copies of those prompt rows, so a prompt is computed once for all its samples. A decode step
feeds each row's last token at its own position and attends over a width that covers every
row, rounded up; on CUDA the rows are padded to a bucket size and the step replays a CUDA graph
captured for that (bucket, width). When samples finish, later rows move down (`keep`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from art.engine.adapters import AdapterSet
from art.engine.config import EngineConfig
from art.engine.cuda_graphs import DecodeGraphs, GraphCaptureError
from art.engine.decoder import Decoder
from art.engine.kv_cache import KVCache, PrefixKV
from art.engine.served_weights import ServedWeights
from art.errors import ArtValueError

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
CUDA_MIN_WIDTH = 256
"""Attention widths on CUDA are powers of two from here: a few graphs per bucket."""
CPU_WIDTH_STEP = 64


@dataclass
class Staged:
    """Prompts computed by a prefill, in a workspace cache (row i = prompt i)."""

    cache: KVCache
    lengths: list[int]


class StaticRunner:
    def __init__(self, model, adapters: AdapterSet, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.pad = config.pad_batches if config.pad_batches is not None else config.on_cuda
        merge = config.merge_lora if config.merge_lora is not None else not config.on_cuda
        self.weights = ServedWeights(model, dtype=config.torch_dtype, merge=merge, pack=not config.on_cuda)
        adapters.merge_live = False  # the engine never merges into the shared modules: `weights` keeps its own copy
        # Padding tokens of a prefill may run past the longest prompt: room for twice the length.
        self.decoder = Decoder(model, self.weights, max_positions=2 * max_model_len, device=self.device,
                               dtype=config.torch_dtype)
        self.max_model_len = max_model_len
        self.max_rows = config.max_num_seqs
        if config.on_cuda:
            self.max_rows = self._cuda_slots()
        self.cache = self._allocate(self.max_rows)
        self.lengths: list[int] = []
        """Tokens in each running row's slot."""
        self.graphs = DecodeGraphs(self.decoder, self.cache) if config.on_cuda and not config.enforce_eager else None
        self.prefill_computed_tokens = 0
        """Prompt tokens actually run through the model (the rest came from cached prefixes)."""

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], prefixes: list[tuple[int, PrefixKV | None]],
                adapter_names: list[str]) -> tuple[torch.Tensor, Staged]:
        """Run prompts (row i after its cached prefix) in one pass: (logits [prompts, vocab], staged)."""
        self.weights.refresh()
        used = [min(n, len(p) - 1) if kv is not None else 0 for p, (n, kv) in zip(prompts, prefixes)]
        rests = [p[n:] for p, n in zip(prompts, used)]
        tokens = max(map(len, rests))
        width = max(used) + tokens
        workspace = self.decoder.kv_cache(max_rows=len(prompts), max_tokens=width, growable=False)
        ids = torch.zeros(len(prompts), tokens, dtype=torch.long, device=self.device)  # [prompts, tokens]
        for i, ((_, kv), n, rest) in enumerate(zip(prefixes, used, rests)):
            if n:
                workspace.load_prefix(i, kv, n)
            ids[i, :len(rest)] = torch.tensor(rest, device=self.device)
        offsets = torch.tensor(used, device=self.device)[:, None]  # [prompts, 1]
        positions = offsets + torch.arange(tokens, device=self.device)  # [prompts, tokens]; padding runs on
        last = torch.tensor([len(r) - 1 for r in rests], device=self.device)
        route = self.weights.route(adapter_names, self.device)
        logits = self.decoder.forward(ids, positions, workspace, width, route, last=last)
        self.prefill_computed_tokens += sum(map(len, rests))
        return logits, Staged(workspace, [len(p) for p in prompts])

    def prompt_kv(self, staged: Staged, index: int) -> PrefixKV:
        return staged.cache.export(index, staged.lengths[index])

    def add(self, staged: Staged, sources: list[int]) -> None:
        """Append one row per entry of `sources`, a copy of staged prompt `sources[k]`."""
        start = len(self.lengths)
        tokens = max(staged.lengths[s] for s in sources)
        self.cache.reserve(start + len(sources), tokens)
        dst = torch.arange(start, start + len(sources), device=self.device)
        self.cache.copy_rows(dst, staged.cache, torch.tensor(sources, device=self.device), tokens)
        self.lengths += [staged.lengths[s] for s in sources]

    # -- decode -------------------------------------------------------------------------------
    def decode(self, tokens: list[int], positions: list[int], adapter_names: list[str]) -> torch.Tensor:
        """One token for every running row at its position: logits [rows, vocab]."""
        self.weights.refresh()
        rows = len(tokens)
        padded = self._bucket(rows) if self.pad else rows
        width = self._width(max(positions) + 1)
        self.cache.reserve(padded, width)
        fill = padded - rows  # padding rows sit in free slots, at position 0
        ids = torch.tensor(tokens + [0] * fill, device=self.device)[:, None]  # [padded, 1]
        where = torch.tensor(positions + [0] * fill, device=self.device)[:, None]
        route = self.weights.route(adapter_names + [adapter_names[0]] * fill, self.device)
        logits = None
        if self.graphs is not None and route.key is not None:
            try:
                logits = self.graphs.run(ids, where, width, route)
            except GraphCaptureError as exc:  # serve on, eagerly: slower, not broken (stats show 0 graphs)
                log.error("%s; decoding without CUDA graphs from now on", exc)
                self.graphs = None
        if logits is None:
            logits = self.decoder.forward(ids, where, self.cache, width, route)
        self.lengths = [p + 1 for p in positions]
        return logits[:rows]

    def keep(self, keep: list[int]) -> None:
        """Keep only these rows (in this order, ascending); later rows move down into free slots."""
        moved = [(i, j) for i, j in enumerate(keep) if i != j]
        if moved:
            dst = torch.tensor([i for i, _ in moved], device=self.device)
            src = torch.tensor([j for _, j in moved], device=self.device)
            self.cache.copy_rows(dst, self.cache, src, max(self.lengths[j] for _, j in moved))
        self.lengths = [self.lengths[j] for j in keep]

    def clear(self) -> None:
        """Forget every row (after a failure); a CPU cache frees its memory."""
        self.lengths = []
        self.cache.release()

    def idle(self) -> None:
        """No rows are running (e.g. a training step is about to start): free what the CPU can."""
        if not self.lengths:
            self.cache.release()

    def weights_changed(self, *, all_weights: bool) -> None:
        self.weights.weights_changed(all_weights=all_weights)

    def stats(self) -> dict[str, float]:
        return {"engine/kv_slots": float(self.max_rows),
                "engine/cuda_graphs": float(len(self.graphs.graphs)) if self.graphs else 0.0,
                "engine/graph_replays": float(self.graphs.replays) if self.graphs else 0.0}

    # -- sizes --------------------------------------------------------------------------------
    def _bucket(self, rows: int) -> int:
        return min(next((b for b in ROW_BUCKETS if b >= rows), rows), max(rows, self.max_rows))

    def _width(self, needed: int) -> int:
        if self.config.on_cuda:
            width = CUDA_MIN_WIDTH
            while width < needed:
                width *= 2
        else:
            width = -(-needed // CPU_WIDTH_STEP) * CPU_WIDTH_STEP
        return min(width, self.cache.max_tokens)

    def _allocate(self, rows: int) -> KVCache:
        growable = not self.config.on_cuda
        try:
            return self.decoder.kv_cache(max_rows=rows, max_tokens=self.max_model_len, growable=growable)
        except torch.cuda.OutOfMemoryError as exc:
            raise _memory_error(f"allocating the KV cache ({rows} slots x {self.max_model_len} tokens) ran out of "
                                "GPU memory") from exc

    def _cuda_slots(self) -> int:
        """KV slots that fit in `gpu_memory_utilization` of the GPU, after what is already there
        (the weights, other processes) and a reserve for prefill and decode activations."""
        config = self.config
        free, total = torch.cuda.mem_get_info(self.device)
        layers, heads, dim = len(self.decoder.layers), self.decoder.kv_heads, self.decoder.head_dim
        element = config.torch_dtype.itemsize
        bytes_per_token = 2 * layers * heads * dim * element
        hidden, vocab = self.decoder.config.hidden_size, self.decoder.config.vocab_size
        inner = getattr(self.decoder.config, "intermediate_size", 4 * hidden)
        reserve = (config.prefill_tokens * (12 * hidden + 4 * inner) * element  # prefill activations
                   + config.prefill_tokens * bytes_per_token  # its workspace cache
                   + config.prefix_cache_tokens * bytes_per_token  # the prefix cache
                   + 4 * config.max_num_seqs * vocab * 4  # decode logits and sampling
                   + (256 << 20))  # graphs, allocator slack
        allowed = total * config.gpu_memory_utilization - (total - free) - reserve
        slots = int(allowed // (self.max_model_len * bytes_per_token))
        gib = 1 << 30
        if slots < 1:
            raise _memory_error(
                f"the KV cache does not fit: gpu_memory_utilization={config.gpu_memory_utilization} of "
                f"{total / gib:.1f} GiB leaves {max(allowed, 0) / gib:.2f} GiB after {(total - free) / gib:.1f} GiB in "
                f"use and a {reserve / gib:.2f} GiB reserve, and one sequence of max_model_len={self.max_model_len} "
                f"needs {self.max_model_len * bytes_per_token / gib:.2f} GiB")
        if slots < config.max_num_seqs:
            log.warning("KV cache: %d slots of %d tokens fit in gpu_memory_utilization=%s (max_num_seqs=%d asked); "
                        "raise gpu_memory_utilization or lower max_model_len for more", slots, self.max_model_len,
                        config.gpu_memory_utilization, config.max_num_seqs)
        return min(slots, config.max_num_seqs)


def _memory_error(what: str) -> ArtValueError:
    return ArtValueError(f"{what}. Raise engine_args.gpu_memory_utilization, or lower engine_args.max_model_len "
                         "or engine_args.max_num_seqs", field="engine_args.gpu_memory_utilization")
