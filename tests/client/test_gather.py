"""gather_trajectory_groups / gather_trajectories / trajectory_group_batches on fake rollouts."""

from __future__ import annotations

import asyncio

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

from art.errors import ArtValueError, TooManyExceptionsError
from art.gather import gather_trajectories, gather_trajectory_groups, trajectory_group_batches
from art.trajectories import Trajectory, TrajectoryGroup


async def rollout(reward: float, fail: bool = False, delay: float = 0.0, tokens: int = 0) -> Trajectory:
    await asyncio.sleep(delay)
    if fail:
        raise ValueError(f"rollout failed ({reward})")
    choice = Choice(
        index=0,
        finish_reason="stop",
        message=ChatCompletionMessage(role="assistant", content="a"),
        token_ids=list(range(tokens)),
    )
    return Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=reward, metrics={"m": 1})


def groups_with_failures(n_groups: int, size: int, failures: int) -> list[TrajectoryGroup]:
    """`failures` failing rollouts spread over the first groups."""
    out, left = [], failures
    for g in range(n_groups):
        rollouts = []
        for i in range(size):
            rollouts.append(rollout(g * 10 + i, fail=left > 0))
            left -= 1
        out.append(TrajectoryGroup(rollouts))
    return out


async def test_all_rollouts_start_before_any_finishes():
    started, everyone_started = 0, asyncio.Event()

    async def waiting_rollout() -> Trajectory:
        nonlocal started
        started += 1
        if started == 12:
            everyone_started.set()
        await everyone_started.wait()  # deadlocks (and times out) unless all 12 run at once
        return Trajectory(reward=1.0)

    groups = [TrajectoryGroup(waiting_rollout() for _ in range(4)) for _ in range(3)]
    result = await asyncio.wait_for(gather_trajectory_groups(groups, pbar_desc=None), timeout=10)
    assert [len(g) for g in result] == [4, 4, 4]


async def test_groups_come_back_in_input_order():
    groups = [TrajectoryGroup(rollout(i, delay=0.05 * (3 - i)) for _ in range(2)) for i in range(4)]
    result = await gather_trajectory_groups(groups, pbar_desc=None)
    assert [g.trajectories[0].reward for g in result] == [0, 1, 2, 3]


@pytest.mark.parametrize(("failures", "limit", "ok"), [(2, 2, True), (3, 2, False), (2, 0.2, True), (3, 0.2, False)])
async def test_max_exceptions_count_and_fraction(failures, limit, ok):
    groups = groups_with_failures(5, 2, failures)  # 10 trajectories
    if ok:
        result = await gather_trajectory_groups(groups, pbar_desc=None, max_exceptions=limit)
        assert sum(len(g) for g in result) == 10 - failures
        assert sum(len(g.exceptions) for g in result) == failures - 2 * (failures // 2)  # fully failed groups drop
        return
    with pytest.raises(TooManyExceptionsError) as info:
        await gather_trajectory_groups(groups, pbar_desc=None, max_exceptions=limit)
    message = str(info.value)
    assert "3 of 10 rollouts raised" in message and "limit 2" in message
    assert "ValueError: rollout failed" in message
    assert isinstance(info.value.__cause__, ValueError)


async def test_default_max_exceptions_is_zero_and_stops_early():
    cancelled = 0

    async def never_finishes() -> Trajectory:
        nonlocal cancelled
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled += 1
            raise
        raise AssertionError("unreachable")

    groups = [TrajectoryGroup([never_finishes(), rollout(0, fail=True)]), TrajectoryGroup([never_finishes()])]
    with pytest.raises(TooManyExceptionsError, match="max_exceptions=0"):
        await asyncio.wait_for(gather_trajectory_groups(groups, pbar_desc=None), timeout=10)
    assert cancelled == 2


async def test_failed_rollouts_are_dropped_and_empty_groups_too():
    groups = [
        TrajectoryGroup([rollout(1), rollout(2, fail=True), rollout(3)]),
        TrajectoryGroup([rollout(4, fail=True), rollout(5, fail=True)]),
        TrajectoryGroup([rollout(6)]),
    ]
    result = await gather_trajectory_groups(groups, pbar_desc=None, max_exceptions=3)
    assert [[t.reward for t in g] for g in result] == [[1, 3], [6]]
    assert [e.message for e in result[0].exceptions] == ["rollout failed (2)"]


async def test_after_each_can_replace_or_drop():
    async def rescore(group: TrajectoryGroup) -> TrajectoryGroup | None:
        if group.trajectories[0].reward == 1:
            return None
        return TrajectoryGroup([t.model_copy(update={"reward": 100 + t.reward}) for t in group])

    groups = [TrajectoryGroup(rollout(r) for _ in range(2)) for r in (0, 1, 2)]
    result = await gather_trajectory_groups(groups, pbar_desc=None, after_each=rescore)
    assert [[t.reward for t in g] for g in result] == [[100, 100], [102, 102]]

    def keep_first(group: TrajectoryGroup) -> TrajectoryGroup:  # a plain function works too
        return TrajectoryGroup(group.trajectories[:1])

    groups = [TrajectoryGroup(rollout(r) for _ in range(2)) for r in (0, 1)]
    result = await gather_trajectory_groups(groups, pbar_desc=None, after_each=keep_first)
    assert [len(g) for g in result] == [1, 1]


async def test_coroutines_returning_groups_and_finished_groups():
    async def make_group(reward: float) -> TrajectoryGroup:
        return await TrajectoryGroup(rollout(reward) for _ in range(2))

    async def broken_group() -> TrajectoryGroup:
        raise KeyError("no scenario")

    ready = TrajectoryGroup([Trajectory(reward=9)])
    result = await gather_trajectory_groups(
        [make_group(1), ready, broken_group()], pbar_desc=None, max_exceptions=1
    )
    assert [[t.reward for t in g] for g in result] == [[1, 1], [9]]
    with pytest.raises(TooManyExceptionsError, match="KeyError"):
        await gather_trajectory_groups([broken_group()], pbar_desc=None)


async def test_progress_bar_shows_reward_and_completion_tokens(capsys):
    groups = [TrajectoryGroup(rollout(r, tokens=3) for _ in range(2)) for r in (0, 1)]
    await gather_trajectory_groups(groups, pbar_desc="gather")
    err = capsys.readouterr().err
    assert "4/4" in err and "reward=0.5" in err and "completion_tokens=12" in err and "m=1" in err
    groups = [TrajectoryGroup([rollout(1, tokens=3)])]
    await gather_trajectory_groups(groups, pbar_desc=None)
    assert capsys.readouterr().err == ""


async def test_bad_arguments_are_rejected():
    with pytest.raises(ArtValueError, match="max_exceptions"):
        await gather_trajectory_groups([], max_exceptions=-1)
    with pytest.raises(ArtValueError, match="awaitables"):
        await gather_trajectory_groups([Trajectory()])  # type: ignore[list-item]
    assert await gather_trajectory_groups([], pbar_desc=None) == []


async def test_gather_trajectories_flat():
    result = await gather_trajectories(
        [rollout(1, delay=0.05), rollout(2, fail=True), rollout(3)], pbar_desc=None, max_exceptions=1
    )
    assert [t.reward for t in result] == [1, 3]
    with pytest.raises(TooManyExceptionsError, match=r"1 of 2 rollouts raised.*\(limit 0\)"):
        await gather_trajectories([rollout(1), rollout(2, fail=True)], pbar_desc=None)


async def test_trajectory_group_batches_is_lazy_bounded_and_skips():
    in_flight = peak = pulled = 0

    async def tracked(reward: float) -> Trajectory:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return Trajectory(reward=reward)

    def source(n: int):
        nonlocal pulled
        for i in range(n):
            pulled += 1
            yield TrajectoryGroup([tracked(i)])

    batches = [b async for b in trajectory_group_batches(source(7), batch_size=2, max_concurrent_batches=2,
                                                          pbar_desc=None)]
    assert [len(b) for b in batches] == [2, 2, 2, 1]
    assert sorted(g.trajectories[0].reward for b in batches for g in b) == list(range(7))
    assert peak <= 4

    pulled = 0
    gen = trajectory_group_batches(source(7), batch_size=2, skip_batches=2, max_concurrent_batches=1,
                                   pbar_desc=None)
    first = await gen.__anext__()
    assert sorted(g.trajectories[0].reward for g in first) == [4, 5]
    assert pulled == 6  # skipped four, ran two: the rest are not pulled yet
    rest = [b async for b in gen]
    assert [[g.trajectories[0].reward for g in b] for b in rest] == [[6]]



async def test_trajectory_group_batches_defaults_to_four_batches_in_flight():
    started, release = 0, asyncio.Event()

    async def counted(reward: float) -> TrajectoryGroup:
        nonlocal started
        started += 1
        await release.wait()  # nothing finishes until counted: what is in flight is the limit
        return TrajectoryGroup([Trajectory(reward=reward)])

    gen = trajectory_group_batches((counted(i) for i in range(20)), batch_size=2, pbar_desc=None)
    first = asyncio.ensure_future(gen.__anext__())
    for _ in range(200):  # let every rollout the generator will start begin
        await asyncio.sleep(0)
    assert started == 8  # ART's default: max_concurrent_batches=4
    release.set()
    await first
    await gen.aclose()


async def test_trajectory_group_batches_failed_rollouts_count_against_each_batch():
    async def failed_group() -> TrajectoryGroup:
        raise RuntimeError("rollout failed")

    rewards = [[t.reward for g in b for t in g.trajectories] async for b in trajectory_group_batches(
        [TrajectoryGroup([rollout(1)]), failed_group(), TrajectoryGroup([rollout(2)])],
        batch_size=1, max_batch_exceptions=1, max_concurrent_batches=1, pbar_desc=None)]
    assert rewards == [[1], [2]]  # the failure is left out, the iteration goes on

    # A failed rollout inside a group counts too, and the budget is each batch's own: one
    # failure in each of two batches passes with max_batch_exceptions=1 ...
    source = [TrajectoryGroup([rollout(1), rollout(0, fail=True)]), TrajectoryGroup([rollout(2), rollout(0, fail=True)])]
    batches = [b async for b in trajectory_group_batches(source, batch_size=1, max_batch_exceptions=1,
                                                         max_concurrent_batches=1, pbar_desc=None)]
    assert [[t.reward for t in b[0].trajectories] for b in batches] == [[1], [2]]
    assert [len(b[0].exceptions) for b in batches] == [1, 1]

    # ... and one more than the budget within a batch raises, naming the first failure.
    source = [TrajectoryGroup([rollout(1), rollout(0, fail=True), rollout(0, fail=True)])]
    with pytest.raises(TooManyExceptionsError, match="2 of 3 rollouts raised, more than max_batch_exceptions=1"):
        [b async for b in trajectory_group_batches(source, batch_size=1, pbar_desc=None, max_batch_exceptions=1)]
    with pytest.raises(ArtValueError, match="max_batch_exceptions must be a count"):
        [b async for b in trajectory_group_batches([], batch_size=1, max_batch_exceptions=-1)]


# -- dynamic sampling ------------------------------------------------------------------------


def scripted_groups(rewards_per_group: list[list[float]], started: list[int]):
    """An endless-looking generator of groups: group k has rewards_per_group[k]; `started`
    records which groups were drawn (a group's rollouts are made only when it is drawn)."""
    for k, rewards in enumerate(rewards_per_group):
        started.append(k)
        yield TrajectoryGroup(rollout(r, delay=0.01 * (k % 3)) for r in rewards)


async def test_dynamic_sampling_keeps_drawing_until_enough_groups_have_signal():
    flat, mixed = [0.5, 0.5], [0.0, 1.0]
    started: list[int] = []
    plan = [flat, mixed, flat, flat, mixed, mixed, mixed, flat]
    result = await gather_trajectory_groups(scripted_groups(plan, started), pbar_desc=None, min_groups_with_signal=3)
    assert len(result) == 3 and all(len({t.reward for t in g.trajectories}) == 2 for g in result)
    assert started == [0, 1, 2, 3, 4, 5]  # no group drawn past the third with signal
    stats = result.stats
    assert (stats.groups_drawn, stats.groups_kept, stats.groups_without_signal, stats.rollouts) == (6, 3, 3, 12)
    assert stats.reward_mean == pytest.approx((0.5 * 6 + 0.0 * 3 + 1.0 * 3) / 12)  # dropped groups count


async def test_dynamic_sampling_stops_at_max_groups_and_returns_what_it_has():
    started: list[int] = []
    plan = [[1.0, 1.0]] * 5 + [[0.0, 1.0]] * 5
    result = await gather_trajectory_groups(scripted_groups(plan, started), pbar_desc=None,
                                            min_groups_with_signal=2, max_groups=4)
    assert result == [] and started == [0, 1, 2, 3]
    assert (result.stats.groups_drawn, result.stats.groups_without_signal, result.stats.rollouts) == (4, 4, 8)


async def test_dynamic_sampling_closes_the_undrawn_coroutines_of_a_list(recwarn):
    groups = [TrajectoryGroup(rollout(r) for r in (0.0, 1.0)) for _ in range(6)]
    result = await gather_trajectory_groups(groups, pbar_desc=None, min_groups_with_signal=2)
    assert len(result) == 2 and result.stats.groups_drawn == 2
    del groups
    import gc

    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


@pytest.mark.parametrize("kwargs, field", [
    ({"min_groups_with_signal": 0}, "min_groups_with_signal"),
    ({"min_groups_with_signal": True}, "min_groups_with_signal"),
    ({"min_groups_with_signal": 3, "max_groups": 2}, "max_groups"),
    ({"max_groups": 8}, "max_groups"),
])
async def test_dynamic_sampling_options_are_checked(kwargs, field):
    with pytest.raises(ArtValueError) as info:
        await gather_trajectory_groups([], pbar_desc=None, **kwargs)
    assert info.value.field == field


async def test_without_dynamic_sampling_the_stats_count_every_rollout():
    groups = groups_with_failures(3, 2, failures=1)
    result = await gather_trajectory_groups(groups, pbar_desc=None, max_exceptions=1)
    assert (result.stats.groups_drawn, result.stats.groups_kept, result.stats.rollouts) == (3, 3, 6)
