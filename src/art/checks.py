"""The checks of one setting each, worded in one place.

Every settings object (training options, engine args, `_internal_config`, the pipeline's sizes)
reports a bad value in the same words, "<name> must be <what>, got <value>", so a user reads one
style whichever object refused them. Each check returns that message, or None when the value is
good, rather than raising: the caller gathers every problem and raises once, listing them all.

Numbers follow `art.numeric` (a bool is never a number) and nan is never a good value; inf is
compared with the bounds like any number, so it passes only where no upper bound excludes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeGuard

from art.numeric import is_int, is_number


def integer(name: str, value: object, *, none_ok: bool = False) -> str | None:
    """Any int (a seed): not a bool, not a float."""
    return _report(name, "an int", value, is_int(value), none_ok)


def int_at_least(name: str, value: object, low: int, *, none_ok: bool = False) -> str | None:
    """A count or a step with a lower bound only."""
    return _report(name, f"an int >= {low}", value, is_int(value) and value >= low, none_ok)


def int_in(name: str, value: object, low: float, high: float, *, none_ok: bool = False) -> str | None:
    """A count between two bounds, both included."""
    good = is_int(value) and low <= value <= high
    return _report(name, f"an int in [{_show(low)}, {_show(high)}]", value, good, none_ok)


def number_at_least(name: str, value: object, low: float, *, none_ok: bool = False) -> str | None:
    """A number (int or float) with a lower bound only, the bound included."""
    return _report(name, f"a number >= {_show(low)}", value, _is_number(value) and value >= low, none_ok)


def positive_number(name: str, value: object, *, none_ok: bool = False) -> str | None:
    """A number above 0 (seconds, a coefficient) with no upper bound."""
    return _report(name, "a number > 0", value, _is_number(value) and value > 0, none_ok)


def number_in(
    name: str, value: object, low: float, high: float, *, low_open: bool = False, none_ok: bool = False
) -> str | None:
    """A number in [low, high], or in (low, high] with `low_open` (a rate that may not be 0)."""
    good = _is_number(value) and (low < value if low_open else low <= value) and value <= high
    return _report(name, f"a number in {'(' if low_open else '['}{_show(low)}, {_show(high)}]", value, good, none_ok)


def boolean(name: str, value: object, *, none_ok: bool = False) -> str | None:
    """A switch: True or False themselves, not 1, 0 or "yes"."""
    return _report(name, "True, False" if none_ok else "True or False", value, isinstance(value, bool), none_ok)


def one_of(name: str, value: object, allowed: Iterable[object]) -> str | None:
    """One of a few choices, None among them where it means "the default" (True matches only True, not 1)."""
    choices = tuple(allowed)
    good = any(_same(value, choice) for choice in choices)
    return _report(name, f"one of {', '.join(map(repr, choices))}", value, good, none_ok=False)


def _report(name: str, what: str, value: object, good: bool, none_ok: bool) -> str | None:
    """The one wording, "<name> must be <what>[ or None], got <value>", unless good or an allowed None."""
    if good or (none_ok and value is None):
        return None
    return f"{name} must be {what}{' or None' if none_ok else ''}, got {value!r}"


def _is_number(value: object) -> TypeGuard[int | float]:
    """A number that can be compared with a bound: nan is below, above and equal to nothing."""
    return is_number(value) and not math.isnan(value)


def _same(value: object, choice: object) -> bool:
    """Equal, where True, False and None equal only themselves (True == 1 to Python)."""
    if isinstance(value, bool) or isinstance(choice, bool) or value is None or choice is None:
        return value is choice
    return bool(value == choice)


def _show(bound: float) -> str:
    """A bound as people write it: 1, 0.5, 1e+06 (a float's shortest form that is still exact)."""
    if isinstance(bound, float) and float(f"{bound:g}") == bound:
        return f"{bound:g}"
    return repr(bound)
