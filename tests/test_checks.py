"""`art.checks`: each check passes a good value (None), and words a bad one "<name> must be ..., got
...", bools, None and nan included."""

from __future__ import annotations

import math

import pytest

from art.checks import (
    boolean,
    int_at_least,
    int_in,
    integer,
    number_at_least,
    number_in,
    one_of,
    positive_number,
)

NAN = math.nan
INF = math.inf


@pytest.mark.parametrize("good", [0, -3, 10**20])
def test_integer_passes_ints(good):
    assert integer("seed", good) is None


@pytest.mark.parametrize("bad", [True, False, 1.0, "1", None, NAN])
def test_integer_refuses_the_rest(bad):
    assert integer("seed", bad) == f"seed must be an int, got {bad!r}"


def test_none_ok_passes_none_and_says_so():
    assert integer("seed", None, none_ok=True) is None
    assert integer("seed", 1.5, none_ok=True) == "seed must be an int or None, got 1.5"


def test_int_at_least():
    assert int_at_least("steps", 0, 0) is None and int_at_least("steps", 7, 1) is None
    assert int_at_least("steps", None, 1, none_ok=True) is None
    for bad in (0, -1, True, 2.0, None, NAN, "3"):
        assert int_at_least("steps", bad, 1) == f"steps must be an int >= 1, got {bad!r}"
    assert int_at_least("steps", False, 0, none_ok=True) == "steps must be an int >= 0 or None, got False"


def test_int_in_includes_both_bounds():
    assert int_in("ranks", 1, 1, 64) is None and int_in("ranks", 64, 1, 64) is None
    assert int_in("ranks", None, 1, 64, none_ok=True) is None
    for bad in (0, 65, True, 3.0, None, NAN):
        assert int_in("ranks", bad, 1, 64) == f"ranks must be an int in [1, 64], got {bad!r}"
    assert int_in("tokens", 0, 1, 1 << 24, none_ok=True) == "tokens must be an int in [1, 16777216] or None, got 0"


def test_number_at_least():
    for good in (0, 0.0, 2.5, 3, INF):
        assert number_at_least("limit", good, 0) is None
    assert number_at_least("limit", None, 0, none_ok=True) is None
    for bad in (-0.1, True, False, None, NAN, "1", -INF):
        assert number_at_least("limit", bad, 0) == f"limit must be a number >= 0, got {bad!r}"


def test_positive_number():
    for good in (1e-9, 1, 60.0, INF):
        assert positive_number("seconds", good) is None
    assert positive_number("seconds", None, none_ok=True) is None
    for bad in (0, 0.0, -1, True, None, NAN, "60"):
        assert positive_number("seconds", bad) == f"seconds must be a number > 0, got {bad!r}"
    assert positive_number("seconds", NAN, none_ok=True) == "seconds must be a number > 0 or None, got nan"


def test_number_in_closed_and_half_open():
    assert number_in("balance", -1, -1, 1) is None and number_in("balance", 1.0, -1, 1) is None
    for bad in (-1.5, 2, True, None, NAN, INF):
        assert number_in("balance", bad, -1, 1) == f"balance must be a number in [-1, 1], got {bad!r}"
    assert number_in("rate", 1.0, 0, 1.0, low_open=True) is None
    assert number_in("rate", 0, 0, 1.0, low_open=True) == "rate must be a number in (0, 1], got 0"
    assert number_in("rate", None, 0, 1.0, low_open=True, none_ok=True) is None
    assert number_in("cap", INF, 0, 1e6, none_ok=True) == "cap must be a number in [0, 1e+06] or None, got inf"
    assert number_in("rate", 0.3, 0, 0.25) == "rate must be a number in [0, 0.25], got 0.3"


def test_boolean():
    assert boolean("ppo", True) is None and boolean("ppo", False) is None
    for bad in (1, 0, "yes", None, NAN):
        assert boolean("ppo", bad) == f"ppo must be True or False, got {bad!r}"
    assert boolean("eager", None, none_ok=True) is None
    assert boolean("eager", 1.0, none_ok=True) == "eager must be True, False or None, got 1.0"


def test_one_of():
    assert one_of("packing", "padded", ("packed", "padded")) is None
    assert one_of("layout", None, ("fixed", None)) is None
    assert one_of("packing", "pad", ["packed", "padded"]) == "packing must be one of 'packed', 'padded', got 'pad'"
    assert one_of("layout", None, ("fixed",)) == "layout must be one of 'fixed', got None"
    scale = (True, False, "group")
    assert one_of("scale", True, scale) is None and one_of("scale", "group", scale) is None
    for bad in (1, 0, 1.0, None, NAN, "batch"):  # True == 1 to Python, never to a setting
        assert one_of("scale", bad, scale) == f"scale must be one of True, False, 'group', got {bad!r}"
    assert one_of("kind", [], ("a",)) == "kind must be one of 'a', got []"  # unhashable: no TypeError
