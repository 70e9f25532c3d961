"""The KV cache's layouts (`art.engine.kv_cache`): a stride change keeps the live rows' keys and
values, in place in a fixed buffer (CUDA's) or into a grown one (the CPU's), and the copies
a step makes stay within one layer (rows moved) or one slot per finished row."""

from __future__ import annotations

import pytest
import torch

from art.engine.kv_cache import KVCache
from art.engine.llm_engine import swap_remove


def filled(cache: KVCache, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write distinct values into the first `length` positions of `rows` slots; return them."""
    keys = torch.randn(cache.shape[0], rows, cache.shape[1], length, cache.shape[2])
    values = torch.randn_like(keys)
    cache.k[:, :rows, :, :length] = keys
    cache.v[:, :rows, :, :length] = values
    return keys, values


@pytest.mark.parametrize("growable", [False, True], ids=["fixed", "growable"])
def test_changing_the_stride_keeps_the_live_rows(growable):
    torch.manual_seed(0)
    cache = KVCache(layers=3, heads=2, head_dim=4, dtype=torch.float32, device="cpu", max_rows=16, max_tokens=64,
                    growable=growable, capacity=256)
    cache.arrange(8, 16, live=0, length=0)
    assert cache.tokens == 16 and cache.rows >= 8
    keys, values = filled(cache, rows=5, length=12)
    for rows, stride, live in [(5, 32, 5), (4, 64, 4), (16, 16, 4), (5, 48, 4)]:  # wider, widest, narrow, back
        cache.arrange(rows, stride, live=live, length=12)
        keys, values = keys[:, :live], values[:, :live]
        assert cache.tokens == stride and cache.rows >= rows and cache.rows * stride <= 256
        torch.testing.assert_close(cache.k[:, :live, :, :12], keys, rtol=0, atol=0)
        torch.testing.assert_close(cache.v[:, :live, :, :12], values, rtol=0, atol=0)
    assert cache.relayouts == 4
    with pytest.raises(ValueError, match="cannot hold"):
        cache.arrange(5, 64, live=2, length=12)  # 320 positions > 256


def test_a_fixed_buffer_is_allocated_once_and_never_grows():
    cache = KVCache(layers=2, heads=1, head_dim=2, dtype=torch.float32, device="cpu", max_rows=8, max_tokens=32,
                    growable=False, capacity=64)
    buffer = cache._k.data_ptr()
    for rows, stride in [(4, 16), (2, 32), (8, 8)]:
        cache.arrange(rows, stride, live=1, length=4)
        assert cache._k.data_ptr() == buffer and cache.k.data_ptr() == buffer
        assert cache.k[0].is_contiguous()  # a decode step's view [:rows, :, :width] at stride width is dense


@pytest.mark.parametrize("finished", [[0], [3], [7], [0, 7], [2, 3, 5], [1, 2, 3, 4, 5, 6], list(range(8)), []])
def test_swap_remove_moves_at_most_one_row_per_finished_row(finished):
    order = swap_remove(finished, 8)
    assert sorted(order) == [i for i in range(8) if i not in finished]  # every survivor once
    moved = [i for i, j in enumerate(order) if i != j]
    assert len(moved) <= len(finished) and all(i in finished for i in moved)  # only into freed slots


def test_copying_rows_within_a_cache_takes_any_order():
    torch.manual_seed(1)
    cache = KVCache(layers=2, heads=2, head_dim=3, dtype=torch.float32, device="cpu", max_rows=4, max_tokens=8,
                    growable=False)
    keys, _ = filled(cache, rows=4, length=8)
    cache.copy_rows(torch.tensor([0, 1, 2]), cache, torch.tensor([1, 2, 0]), 8)  # a rotation: sources overlap
    torch.testing.assert_close(cache.k[:, :3], keys[:, [1, 2, 0]], rtol=0, atol=0)
    assert cache.rows_moved == 3


def test_a_workspace_holding_one_prompt_exports_it_without_a_copy():
    one = KVCache(layers=2, heads=2, head_dim=3, dtype=torch.float32, device="cpu", max_rows=1, max_tokens=10,
                  growable=False)
    keys, values = one.export(0, 10)
    assert keys.data_ptr() == one.k.data_ptr()  # the prefix cache keeps the workspace itself
    two = KVCache(layers=2, heads=2, head_dim=3, dtype=torch.float32, device="cpu", max_rows=2, max_tokens=10,
                  growable=False)
    assert two.export(1, 10)[0].data_ptr() != two.k.data_ptr() + two.k[:, 1].storage_offset()
    assert one.export(0, 6)[0].data_ptr() != one.k.data_ptr()  # a prefix of it is copied (the rest is freed)
