"""The check every CUDA graph passes before it serves (`cuda_graphs.check_other_steps`), run on
the CPU over CUDA's KV layout with stand-in replays: an honest replay passes and leaves the live
rows' cache and the input buffers as they were; replays that fixed a value at capture, or that
do not write the keys the next step reads, are refused."""

from __future__ import annotations

import pytest
import torch

from art.engine.adapters import LIVE, AdapterSet
from art.engine.config import EngineConfig
from art.engine.cuda_graphs import GraphCaptureError, check_other_steps
from art.engine.static_runner import StaticRunner
from tests.support.models import tiny_model


@pytest.fixture(scope="module")
def running():
    """A runner on CUDA's layout with three live rows, and its decode inputs padded to 4 rows."""
    model = tiny_model("qwen3")
    config = EngineConfig(kv_layout="fixed", pad_batches=True, merge_lora=False).resolve(model)
    runner = StaticRunner(model, AdapterSet(model), config, max_model_len=128)
    prompts = [[5, 9, 13, 200, 7], list(range(20, 41)), [3, 1, 4, 1, 5, 9, 2, 6]]
    with torch.inference_mode():
        _, staged = runner.prefill(prompts, [(0, None)] * 3, [LIVE] * 3)
        runner.add(staged, [0, 1, 2])
        runner.decode([11, 12, 13], [len(p) for p in prompts], [LIVE] * 3)  # arranges the layout
    width = runner.row_width(max(len(p) for p in prompts) + 2)
    route = runner.weights.route([LIVE] * 4, runner.device)
    return runner, width, route


def buffers(runner, rows=4):
    ids = torch.tensor([[21], [22], [23], [0]])
    positions = torch.tensor([[6], [22], [9], [0]])
    return ids, positions, torch.empty(rows, runner.decoder.config.vocab_size)


def check(runner, width, route, replay_of):
    ids, positions, out = buffers(runner)
    with torch.inference_mode():
        check_other_steps(replay_of(ids, positions, out), runner.decoder, runner.cache, ids, positions, out,
                          width, route)
    return ids, positions


def test_an_honest_replay_passes_and_puts_back_the_inputs_and_the_live_rows_cache(running):
    runner, width, route = running
    keys, values = runner.cache.k.clone(), runner.cache.v.clone()

    def honest(ids, positions, out):
        return lambda: out.copy_(runner.decoder.forward(ids, positions, runner.cache, width, route))

    ids, positions = check(runner, width, route, honest)
    assert torch.equal(ids, buffers(runner)[0]) and torch.equal(positions, buffers(runner)[1])
    assert torch.equal(runner.cache.k, keys) and torch.equal(runner.cache.v, values)


def test_a_replay_that_fixed_its_inputs_at_capture_is_refused(running):
    """The first H200 run's fault looked like this: right on the recorded inputs, wrong after."""
    runner, width, route = running

    def frozen(ids, positions, out):
        recorded = ids.clone(), positions.clone()
        return lambda: out.copy_(runner.decoder.forward(*recorded, runner.cache, width, route))

    with pytest.raises(GraphCaptureError, match="step 1 of 2 on other tokens and positions"):
        check(runner, width, route, frozen)


def test_a_replay_whose_key_writes_the_next_step_does_not_read_is_refused(running):
    """Right on each step alone, but what it writes is not where the next step reads (as a graph
    recorded against a cache buffer that was later replaced): here its writes are undone."""
    runner, width, route = running

    def unwritten(ids, positions, out):
        def replay():
            keys, values = runner.cache.k.clone(), runner.cache.v.clone()
            out.copy_(runner.decoder.forward(ids, positions, runner.cache, width, route))
            runner.cache.k.copy_(keys)
            runner.cache.v.copy_(values)
        return replay

    with pytest.raises(GraphCaptureError, match="step 2 of 2"):
        check(runner, width, route, unwritten)
