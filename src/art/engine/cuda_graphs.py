"""Decode steps replayed as CUDA graphs: one graph per (rows bucket, attention width, weights).

Without graphs a small model's decode step is bound by Python and kernel launches, not by the
GPU (the 135M and 1.5B models decoded at the same rate in the H200 measurements). A graph
records the whole step once and replays it with one launch. It reads fixed addresses: the
input buffers here, the KV cache (allocated once on CUDA), the model's weights and LoRA
parameters (updated in place by the optimizer and by checkpoint restores) and the prepared
weights of `ServedWeights` (refreshed in place). Graphs are captured lazily, the first time a
shape is needed, and share one memory pool (they never run at the same time).

Batches that mix adapters, or use a checkpoint adapter whose tensors may be evicted, run
eagerly (`Route.key` is None for them).
"""

from __future__ import annotations

import logging

import torch

from art.engine.decoder import Decoder
from art.engine.kv_cache import KVCache
from art.engine.served_weights import Route

log = logging.getLogger(__name__)


class GraphCaptureError(RuntimeError):
    """Recording a decode step failed (the step itself may still run eagerly)."""


class DecodeGraphs:
    def __init__(self, decoder: Decoder, cache: KVCache) -> None:
        self.decoder, self.cache = decoder, cache
        device = cache.device
        self.ids = torch.zeros(cache.max_rows, 1, dtype=torch.long, device=device)  # [slots, 1]
        self.positions = torch.zeros(cache.max_rows, 1, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        """Decode steps served by a graph (the engine's stats report it)."""

    def run(self, ids: torch.Tensor, positions: torch.Tensor, width: int, route: Route) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step; ids, positions [rows, 1] (rows: a bucket size)."""
        rows = ids.shape[0]
        self.ids[:rows].copy_(ids)
        self.positions[:rows].copy_(positions)
        key = (rows, width, route.key)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(rows, width, route)
            except RuntimeError as exc:
                raise GraphCaptureError(f"capturing the decode step for {rows} rows, width {width} "
                                        f"({route.key} weights) as a CUDA graph failed: {exc}") from exc
        graph, logits = entry
        graph.replay()
        self.replays += 1
        return logits

    def _capture(self, rows: int, width: int, route: Route) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (allocations, lazily prepared weights), then record. The inputs
        hold this step's real values, so the warm-up's key/value writes are the ones the step
        makes anyway (a decode step rewrites the same positions with the same values)."""
        ids, positions = self.ids[:rows], self.positions[:rows]
        stream = torch.cuda.Stream(device=self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.decoder.forward(ids, positions, self.cache, width, route)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.decoder.forward(ids, positions, self.cache, width, route)
        self.pool = graph.pool()
        log.debug("captured a decode graph: %d rows, width %d, %s weights", rows, width, route.key)
        return graph, logits
