"""Scheduler policy with plain request objects (the scheduler imports no torch)."""

import pytest

from art.engine.base import SamplingParams
from art.engine.scheduler import Scheduler
from art.engine.sequence import Request, Sample, Status
from art.errors import ArtValueError


def request(prompt_len=4, n=1, max_tokens=4):
    r = Request([1] * prompt_len, SamplingParams(n=n, max_tokens=max_tokens), None, deliver=lambda _: None)
    r.samples = [Sample(r, i) for i in range(n)]
    return r


def test_admits_in_order_within_the_sequence_budget():
    s = Scheduler(max_num_seqs=4, max_kv_tokens=10_000)
    a, b, c = request(n=2), request(n=2), request(n=1)
    for r in (a, b, c):
        s.add(r)
    assert s.admit() == [a, b] and s.queue_depth == 1
    assert all(x.status is Status.RUNNING for x in a.samples + b.samples)
    assert s.admit() == []  # c waits for a free row; it is not skipped ahead
    assert s.finish([a.samples[0]]) == []  # a is complete only when both samples are
    assert s.admit() == [c]
    assert s.finish([a.samples[1]]) == [a]
    assert len(s.running) == 3


def test_first_in_line_is_not_overtaken_by_smaller_requests():
    s = Scheduler(max_num_seqs=4, max_kv_tokens=10_000)
    s.add(request(n=3))
    s.admit()
    big, small = request(n=2), request(n=1)
    s.add(big)
    s.add(small)
    assert s.admit() == []  # big does not fit; small must not jump the queue
    assert s.queue_depth == 2


def test_kv_token_budget_bounds_what_runs():
    s = Scheduler(max_num_seqs=64, max_kv_tokens=100)
    first, second = request(prompt_len=30, max_tokens=20), request(prompt_len=30, max_tokens=20)
    s.add(first)
    s.add(second)
    s.add(request(prompt_len=30, max_tokens=20))
    assert s.admit() == [first, second] and s.reserved_tokens == 100
    s.finish(first.samples)
    assert s.reserved_tokens == 50 and len(s.admit()) == 1


def test_requests_that_could_never_run_are_refused_naming_the_field():
    s = Scheduler(max_num_seqs=8, max_kv_tokens=100)
    with pytest.raises(ArtValueError) as info:
        s.add(request(n=9))
    assert info.value.field == "n"
    with pytest.raises(ArtValueError) as info:
        s.add(request(prompt_len=90, max_tokens=20))
    assert info.value.field == "max_tokens"
    assert s.idle


def test_paused_scheduler_admits_nothing():
    s = Scheduler(max_num_seqs=8, max_kv_tokens=1000)
    s.add(request())
    s.paused = True
    assert s.admit() == [] and s.queue_depth == 1
    s.paused = False
    assert len(s.admit()) == 1


def test_a_cache_with_one_stride_counts_every_row_at_the_width_of_the_longest():
    """On CUDA every slot has the stride of the widest row, so a long request limits how many
    short ones fit beside it, and a request whose rows could never fit is refused."""
    widths = lambda length: 256 * -(-length // 256)  # noqa: E731  (the runner's rounding, simplified)
    s = Scheduler(max_num_seqs=64, max_kv_tokens=4 * 256, row_width=widths, max_model_len=2048)
    short = [request(prompt_len=40, max_tokens=60) for _ in range(5)]
    for r in short:
        s.add(r)
    assert s.admit() == short[:4]  # 4 rows x 256 fill the cache; the sum of lengths (400) would admit all
    s.finish(short[0].samples)
    assert s.admit() == [short[4]]
    long = request(prompt_len=300, max_tokens=100)  # width 512: with it only 2 rows fit
    s.add(long)
    assert s.admit() == []
    s.finish(short[1].samples + short[2].samples + short[3].samples)
    assert s.admit() == [long] and len(s.running) == 2
    with pytest.raises(ArtValueError) as info:
        s.add(request(prompt_len=40, n=5, max_tokens=60))  # 5 rows x 256 > 1024
    assert info.value.field == "max_tokens" and "width of the longest" in str(info.value)
    wide = Scheduler(max_num_seqs=64, max_kv_tokens=2048, row_width=widths, max_model_len=2048)
    wide.check(request(prompt_len=100, max_tokens=10_000))  # its rows end at max_model_len: one fits
