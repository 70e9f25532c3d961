"""What counts as a number in settings and data: an int or a float, never a bool (True is an int to
Python, but never a count, a step or a reward to us). The one test every validator uses."""

from __future__ import annotations

import math
from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float that is not a bool (inf and nan included: see `is_finite`)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: object) -> TypeGuard[int | float]:
    """A number (`is_number`) that is neither inf nor nan."""
    return is_number(value) and math.isfinite(value)
