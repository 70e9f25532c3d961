"""The pipeline's admission gate on plain numbers (`art.pipeline_trainer.admission`): when a rollout
worker may start a scenario. The end-to-end behaviour is tests/e2e/test_pipeline.py."""

from __future__ import annotations

import math

import pytest

from art.pipeline_trainer.admission import PRIOR_GROUPS, PRIOR_WITH_SIGNAL, Gate, signal_share


def gate(**changes) -> Gate:
    values = dict(next_step=3, max_batch_size=2, age_bound=1, last_step=None, queue_maxsize=100, wait_for_stale=False)
    return Gate(**{**values, **changes})


def test_the_signal_share_starts_from_the_prior_and_follows_what_finished():
    assert signal_share(0, 0) == PRIOR_WITH_SIGNAL / PRIOR_GROUPS == 0.75
    assert signal_share(1, 3) == pytest.approx((1 + 3) / (4 + 4))
    assert signal_share(100, 0) > 0.99 and signal_share(0, 100) < 0.03


def test_a_group_may_train_up_to_its_age_bound_and_never_past_the_last_step():
    assert gate().last_step_for(3) == 4
    assert gate(last_step=3).last_step_for(3) == 3
    assert gate(age_bound=None, last_step=7).last_step_for(3) == 7
    assert gate(age_bound=None).last_step_for(3) is None
    assert gate().places_until(4) == 4  # steps 3 and 4, two places each
    assert gate().places_until(2) == 0  # a deadline before the step being formed: no place
    assert gate().places_until(None) == math.inf


def test_running_groups_count_as_their_share_and_fill_at_most_the_places_left():
    # Policy 3, bound 1: steps 3 and 4 have 4 places; five running groups at 3/4 fill 3.75 of them.
    assert gate().may_start(3, ready=[], running=[3] * 5, share=0.75)
    assert gate().places_filled([], [3] * 6, share=0.75) == 4.0  # capped: 4.5 would overflow
    assert not gate().may_start(3, ready=[], running=[3] * 6, share=0.75)


def test_a_group_too_old_for_every_place_left_fills_none():
    # Sampled by policy 1, bound 1: its last step is 2, before the step being formed (3).
    assert gate().places_filled(ready=[1], running=[], share=0.75) == 0.0
    assert gate().may_start(3, ready=[1, 1, 1], running=[3, 3, 3], share=1.0)


def test_waiting_for_stale_groups_with_a_bound_of_zero_is_one_batch_at_a_time():
    sync = gate(age_bound=0, wait_for_stale=True)
    assert sync.may_start(3, ready=[], running=[3], share=0.5)
    assert not sync.may_start(3, ready=[], running=[3, 3], share=0.5)  # every group counts in full
    assert not sync.may_start(3, ready=[3], running=[3], share=0.5)


def test_no_group_starts_that_no_step_left_could_train():
    last = gate(age_bound=4, last_step=3)  # the last step of max_steps is being formed
    assert last.may_start(3, ready=[], running=[3], share=1.0)
    assert not last.may_start(3, ready=[3], running=[3], share=1.0)


def test_a_full_queue_stops_every_start_and_no_bound_stops_none():
    assert not gate(queue_maxsize=2).may_start(3, ready=[3, 3], running=[], share=1.0)
    unbounded = gate(age_bound=None)
    assert unbounded.may_start(3, ready=[3] * 50, running=[3] * 500, share=1.0)
