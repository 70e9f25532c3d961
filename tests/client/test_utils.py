"""iterate_dataset (determinism, resume), retry (sync and async), limit_concurrency."""

from __future__ import annotations

import asyncio
import importlib
import random

import pytest

from art import retry
from art.errors import ArtValueError
from art.utils import DatasetBatch, iterate_dataset, limit_concurrency

retry_module = importlib.import_module("art._retry")


def run(dataset, **kwargs) -> list[DatasetBatch]:
    return list(iterate_dataset(dataset, use_tqdm=False, **kwargs))


def test_iterate_dataset_shapes_and_epochs():
    batches = run(list(range(10)), groups_per_step=4, num_epochs=2)
    assert [len(b.items) for b in batches] == [4, 4, 2, 4, 4, 2]  # the partial batch is kept
    assert [b.step for b in batches] == list(range(6))
    assert [(b.epoch, b.epoch_step) for b in batches] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for epoch in (0, 1):
        items = [x for b in batches if b.epoch == epoch for x in b.items]
        assert sorted(items) == list(range(10))
    first, second = ([x for b in batches if b.epoch == e for x in b.items] for e in (0, 1))
    assert first != second  # a fresh shuffle each epoch


def test_iterate_dataset_is_deterministic_and_seeded():
    data = list(range(20))
    assert [b.items for b in run(data, groups_per_step=3)] == [b.items for b in run(data, groups_per_step=3)]
    assert run(data, seed=1) != run(data, seed=2)


@pytest.mark.parametrize("initial_step", [0, 1, 3, 4, 7, 8, 50])
def test_resume_continues_exactly_where_it_stopped(initial_step):
    data = [f"s{i}" for i in range(11)]
    full = run(data, groups_per_step=3, num_epochs=2)  # 4 steps per epoch, 8 in all
    resumed = run(data, groups_per_step=3, num_epochs=2, initial_step=initial_step)
    assert resumed == full[initial_step:]


def test_iterate_dataset_leaves_the_global_random_state_alone():
    random.seed(5)
    expected = [random.random() for _ in range(3)]
    random.seed(5)
    next(iterate_dataset(list(range(10)), groups_per_step=2, num_epochs=2, use_tqdm=False))
    assert [random.random() for _ in range(3)] == expected  # a user's seeded run is not disturbed


def test_iterate_dataset_edge_cases(capsys):
    assert run([]) == []
    assert run([1, 2], num_epochs=0) == []
    with pytest.raises(ArtValueError, match="groups_per_step.*initial_step"):
        run([1], groups_per_step=0, initial_step=-1)
    list(iterate_dataset([1, 2, 3], initial_step=1))  # with the bar
    assert "3/3" in capsys.readouterr().err


@pytest.fixture
def sleeps(monkeypatch):
    waits: list[float] = []

    async def fake_async_sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(retry_module.time, "sleep", waits.append)
    monkeypatch.setattr(retry_module.asyncio, "sleep", fake_async_sleep)
    return waits


def test_retry_sync_until_success_with_backoff(sleeps):
    calls, seen = [], []

    @retry(max_attempts=4, delay=0.5, backoff_factor=3, on_retry=lambda e, n: seen.append((str(e), n)))
    def flaky(x: int) -> int:
        """Doc."""
        calls.append(x)
        if len(calls) < 3:
            raise ConnectionError(f"try {len(calls)}")
        return x * 2

    assert flaky(21) == 42
    assert len(calls) == 3 and sleeps == [0.5, 1.5]
    assert seen == [("try 1", 1), ("try 2", 2)]
    assert flaky.__name__ == "flaky" and flaky.__doc__ == "Doc."


def test_retry_sync_gives_up_and_filters(sleeps):
    calls = []

    @retry(max_attempts=3, exceptions=(KeyError,))
    def always(kind: type[Exception]) -> None:
        calls.append(kind)
        raise kind("boom")

    with pytest.raises(KeyError, match="boom"):
        always(KeyError)
    assert len(calls) == 3 and len(sleeps) == 2
    calls.clear()
    with pytest.raises(ValueError):
        always(ValueError)  # not in `exceptions`: no retry
    assert len(calls) == 1


async def test_retry_async(sleeps):
    calls = 0

    @retry(max_attempts=2, delay=0.1)
    async def flaky() -> str:
        nonlocal calls
        calls += 1
        raise TimeoutError("slow")

    assert asyncio.iscoroutinefunction(flaky)
    with pytest.raises(TimeoutError):
        await flaky()
    assert calls == 2 and sleeps == [0.1]

    @retry
    async def fine() -> str:
        return "ok"

    assert await fine() == "ok"


def test_retry_validates_arguments():
    with pytest.raises(ArtValueError, match="max_attempts.*delay.*exceptions") as info:
        retry(max_attempts=0, delay=-1, exceptions=("nope",))  # type: ignore[arg-type]
    assert info.value.field == "max_attempts"
    with pytest.raises(ArtValueError, match="backoff_factor"):
        retry(backoff_factor=float("nan"))
    assert retry(exceptions=KeyError)  # a single class is accepted


async def test_limit_concurrency_bounds_calls():
    running = peak = 0

    @limit_concurrency(2)
    async def work(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return i

    assert await asyncio.gather(*(work(i) for i in range(6))) == list(range(6))
    assert peak == 2


async def test_limit_concurrency_per_key():
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    @limit_concurrency(1, derive_key=lambda key, i: key)
    async def work(key: str, i: int) -> None:
        running[key] = running.get(key, 0) + 1
        peak[key] = max(peak.get(key, 0), running[key])
        await asyncio.sleep(0.01)
        running[key] -= 1

    await asyncio.gather(*(work(k, i) for k in "ab" for i in range(3)))
    assert peak == {"a": 1, "b": 1} and max(running.values()) == 0


def test_limit_concurrency_works_across_event_loops():
    @limit_concurrency(1)
    async def work() -> int:
        await asyncio.sleep(0)
        return 1

    async def many() -> list[int]:
        return await asyncio.gather(work(), work())

    for _ in range(2):  # a semaphore bound to the first loop would fail in the second
        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(many()) == [1, 1]
        finally:
            loop.close()
    with pytest.raises(ArtValueError):
        limit_concurrency(0)
