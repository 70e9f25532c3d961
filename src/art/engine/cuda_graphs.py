"""Decode steps replayed as CUDA graphs: one graph per (rows bucket, attention width, weights).

Without graphs a small model's decode step is bound by Python and kernel launches, not by the
GPU (the 135M and 1.5B models decoded at the same rate in the H200 measurements). A graph
records the whole step once and replays it with one launch. It reads fixed addresses: the
input buffers here, the KV cache (allocated once on CUDA; for a given width its layout is
always the same, `kv_cache.py`), the model's weights and LoRA parameters (updated in place by
the optimizer and by checkpoint restores) and the prepared weights of `ServedWeights`
(refreshed in place). Every graph writes its logits into one shared buffer, so graphs pin no
output memory of their own; they share one memory pool (they never run at the same time).

How a capture is kept honest:
- It records on a stream of the engine's own device, under `torch.cuda.device(...)`: a
  stream of another device would record nothing (an "empty" graph whose replays return the
  capture step's logits forever).
- One capture at a time in the process (`CAPTURE_LOCK`; torch allows one), in "thread_local"
  mode, so another model's engine or trainer thread that allocates or syncs meanwhile does
  not invalidate it. What of ours would still break a capture (`torch.cuda.empty_cache`)
  takes the lock: `empty_cache()` here.
- After recording, the output is poisoned with NaN and the graph replayed: it must give the
  eager step's logits, or it is not used. A warning that the graph is empty fails it too.
- Then two decode steps on other inputs (other tokens, at positions p and p + 1 per row, not
  the recorded ones) run eagerly, the keys and values they wrote are overwritten (`POISON`), and the
  graph replays the same two steps: each must give the eager step's logits. So a value fixed at
  capture (a position, a token, an address read on the host) or a key/value write the next step
  does not read fails the check, as in `tests/engine/test_cuda.py`'s graph-versus-eager test,
  which the first H200 run failed (max difference 0.69). The cache entries the check
  overwrites are saved and restored, so live rows keep theirs.
- A shape that fails decodes eagerly, is counted (`failures`, in /health) and is tried again
  after `RETRY_AFTER_STEPS` replays; the other shapes keep their graphs.

The shapes live serving needs first (every bucket at the narrowest width, the live weights)
are captured when the engine starts (`capture`); wider ones when first needed. Batches that
mix adapters, or use a checkpoint adapter whose tensors may be evicted, run eagerly
(`Route.key` is None for them).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable

import torch

from art.engine.decoder import Decoder
from art.engine.kv_cache import KVCache
from art.engine.served_weights import Route

log = logging.getLogger(__name__)

CAPTURE_LOCK = threading.Lock()
"""Held while any engine of this process records a graph (and by `empty_cache`)."""
RETRY_AFTER_STEPS = 1000
"""Replays after which a shape whose capture failed is tried again."""
REPLAY_TOLERANCE = 1e-2
"""Replay vs eager logits (rtol and atol): the same kernels on the same inputs agree far closer;
a graph that recorded nothing gives NaN (the poisoned output)."""


POISON = 100.0
"""What the check writes over the keys and values a replay must write itself: read instead,
it moves the logits far past the tolerance."""


class GraphCaptureError(RuntimeError):
    """Recording a decode step failed, or its replay did not compute the step."""


def empty_cache() -> None:
    """`torch.cuda.empty_cache()`, never during another thread's capture (it frees memory a
    capture may be recording into)."""
    with CAPTURE_LOCK:
        torch.cuda.empty_cache()


def _graph_key(route: Route) -> str:
    """`route.key`, which every batch a graph may serve has (the runner decodes the others eagerly)."""
    key = route.key
    if key is None:
        raise ValueError("no CUDA graph serves these weights (mixed adapters, or a checkpoint's): decode eagerly")
    return key


class DecodeGraphs:
    def __init__(self, decoder: Decoder, cache: KVCache, max_rows: int) -> None:
        self.decoder, self.cache = decoder, cache
        self.device = cache.device
        with torch.cuda.device(self.device):
            self.ids = torch.zeros(max_rows, 1, dtype=torch.long, device=self.device)  # [slots, 1]
            self.positions = torch.zeros(max_rows, 1, dtype=torch.long, device=self.device)
            self.out = torch.empty(max_rows, decoder.config.vocab_size, dtype=torch.float32, device=self.device)
            self.stream = torch.cuda.Stream(device=self.device)
            self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}
        self.retry_at: dict[tuple[int, int, str], int] = {}
        """Shapes whose capture failed -> the replay count at which to try again."""
        self.replays = 0
        """Decode steps served by a graph (the engine's stats report it)."""
        self.failures = 0
        self.last_failure = ""

    def run(self, ids: torch.Tensor, positions: torch.Tensor, width: int, route: Route) -> torch.Tensor | None:
        """Logits [rows, vocab] of one decode step (a view of the shared output, valid until the
        next step), or None when this shape has no working graph (decode it eagerly)."""
        rows = ids.shape[0]
        key = (rows, width, _graph_key(route))
        with torch.cuda.device(self.device):
            self.ids[:rows].copy_(ids)
            self.positions[:rows].copy_(positions)
            graph = self.graphs.get(key)
            if graph is None:
                if self.retry_at.get(key, 0) > self.replays or not self._record(key, route):
                    return None
                graph = self.graphs[key]
            graph.replay()
        self.replays += 1
        return self.out[:rows]

    def capture(self, rows: int, width: int, route: Route) -> bool:
        """Record a shape ahead of serving (inputs: token 0 at position 0); False if it failed."""
        with torch.cuda.device(self.device):
            self.ids[:rows].zero_()
            self.positions[:rows].zero_()
            return self._record((rows, width, _graph_key(route)), route)

    def _record(self, key: tuple[int, int, str], route: Route) -> bool:
        rows, width, _ = key
        try:
            self.graphs[key] = self._capture(rows, width, route)
        except Exception as exc:  # a CUDA error, an out-of-memory, or the replay check
            self.failures += 1
            self.last_failure = f"{rows} rows, width {width}, {route.key} weights: {exc}"
            self.retry_at[key] = self.replays + RETRY_AFTER_STEPS
            log.error(
                "the CUDA graph for %s failed; that shape decodes eagerly (slower, correct) and is tried again "
                "after %d graph steps",
                self.last_failure,
                RETRY_AFTER_STEPS,
            )
            return False
        self.retry_at.pop(key, None)
        log.debug("captured a decode graph: %d rows, width %d, %s weights", rows, width, route.key)
        return True

    def _capture(self, rows: int, width: int, route: Route) -> torch.cuda.CUDAGraph:
        """Warm up on the side stream (allocations, lazily prepared weights, library handles), record,
        then check a replay against the warm-up's eager logits. The inputs hold this step's real
        values, so the key/value writes of warm-up and replays are the ones the step makes anyway
        (a decode step rewrites the same positions with the same values)."""
        ids, positions, out = self.ids[:rows], self.positions[:rows], self.out[:rows]
        current = torch.cuda.current_stream(self.device)
        with CAPTURE_LOCK:
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for _ in range(2):
                    eager = self.decoder.forward(ids, positions, self.cache, width, route)
            current.wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                        self.decoder.forward(ids, positions, self.cache, width, route, out=out)
            except BaseException:
                _stop_recording_into(self.device, self.pool)
                raise
            for warning in caught:
                log.warning("while recording a decode graph (%d rows, width %d): %s", rows, width, warning.message)
            empty = [str(w.message) for w in caught if "empty" in str(w.message).lower()]
            if empty:
                raise GraphCaptureError(f"the recorded graph is empty: {empty[0]}")
            out.fill_(float("nan"))
            graph.replay()
            _same_logits(out, eager, "the recorded step")
            check_other_steps(graph.replay, self.decoder, self.cache, ids, positions, out, width, route)
        return graph

    def stats(self) -> dict[str, float]:
        return {
            "engine/cuda_graphs": float(len(self.graphs)),
            "engine/graph_replays": float(self.replays),
            "engine/graph_failures": float(self.failures),
        }


def check_other_steps(
    replay: Callable[[], None],
    decoder: Decoder,
    cache: KVCache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    width: int,
    route: Route,
) -> None:
    """Raise GraphCaptureError unless `replay()`, a recorded decode step reading `ids` and
    `positions` [rows, 1] and writing `out` [rows, vocab], computes two steps on other inputs as
    eager steps do (the module docstring). The inputs and the cache entries it uses are put back."""
    rows = ids.shape[0]
    recorded = ids.clone(), positions.clone()
    row = torch.arange(rows, device=ids.device)
    first = (row * 7 + 3) % (width - 1)  # p + 1 < width
    steps = [((row * 31 + 17 + 5 * step) % decoder.config.vocab_size, first + step) for step in (0, 1)]
    slots, written = torch.cat([row, row]), torch.cat([first, first + 1])
    keys, values = cache.k, cache.v  # [layers, slots, heads, stride, dim]
    saved = keys[:, slots, :, written].clone(), values[:, slots, :, written].clone()
    try:
        eager = [
            decoder.forward(step_ids[:, None], step_positions[:, None], cache, width, route)
            for step_ids, step_positions in steps
        ]
        # The replays must write what their next step reads. (Finite: a masked NaN still spoils
        # attention, as 0 x NaN.)
        keys[:, slots, :, written] = POISON
        values[:, slots, :, written] = POISON
        for index, (step_ids, step_positions) in enumerate(steps):
            ids.copy_(step_ids[:, None])
            positions.copy_(step_positions[:, None])
            out.fill_(float("nan"))
            replay()
            _same_logits(out, eager[index], f"step {index + 1} of 2 on other tokens and positions")
    finally:
        keys[:, slots, :, written], values[:, slots, :, written] = saved
        ids.copy_(recorded[0])
        positions.copy_(recorded[1])


def _same_logits(replayed: torch.Tensor, eager: torch.Tensor, what: str) -> None:
    if not torch.allclose(replayed, eager, rtol=REPLAY_TOLERANCE, atol=REPLAY_TOLERANCE):
        diff = float((replayed - eager).abs().max())
        raise GraphCaptureError(
            f"its replay does not compute {what} (max |replay - eager| = {diff:.3g}; nan means it wrote nothing)"
        )


def _stop_recording_into(device: torch.device, pool) -> None:
    """A capture that failed inside `capture_end` can leave the caching allocator recording into
    the graph pool (it then defers every free); end that, if it is so."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device.index, pool)
        except RuntimeError:  # "not currently recording": capture_end already ended it
            pass
