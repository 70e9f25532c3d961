"""Names that arrive from users, checked in one place: `name@step`, and user text in messages.

Torch-free (the client imports it). Every error message that quotes something a request sent
goes through `echo`, so a lone surrogate, a megabyte of text or a control character can never
break the JSON of the answer or flood the log.
"""

from __future__ import annotations

import re

from art.errors import ModelNotFoundError

ECHO_CHARS = 120
"""Longest quote of user text in an error message."""
MAX_STEP_DIGITS = 9
"""Steps are at most 999,999,999: no int parsing of thousands of digits."""
MAX_STEP = 10**MAX_STEP_DIGITS - 1
MAX_METRIC_NAME = 256
"""Longest metric name in a history row."""
_STEP = re.compile(rf"[0-9]{{1,{MAX_STEP_DIGITS}}}")


def echo(value) -> str:
    """`value` quoted for an error message: ASCII only (escapes for the rest), at most ECHO_CHARS."""
    text = ascii(value) if isinstance(value, str) else ascii(repr(value))
    if len(text) <= ECHO_CHARS:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
    return f"{text[:ECHO_CHARS]}... ({size})"


def model_part(requested: str) -> str:
    """The model name in a request's `model` (`name` of `name@step`), the step unchecked: for
    finding who should answer before `parse_served_name` checks the step."""
    return requested.partition("@")[0]


def parse_served_name(requested: str) -> tuple[str, int | None]:
    """A request's `model`: `name` -> (name, None); `name@N` -> (name, N), N in 1-9 ASCII digits.

    Anything else after '@' ("tiny@", "tiny@²", a 5,000-digit number, "tiny@-1") names no
    model: ModelNotFoundError (a 404 naming `model`)."""
    name, at, step = requested.partition("@")  # the one place a step is read from a name
    if not at:
        return name, None
    if not _STEP.fullmatch(step):
        raise ModelNotFoundError(
            f"model {echo(requested)}: the step after '@' must be a number of at most {MAX_STEP_DIGITS} digits"
        )
    return name, int(step)
