"""The checks of a number a user gives a setting (no layer of its own, like ``_sizes``).

Why one place: settings compared a value with its bound alone (``value < 1``), which
lets through what compares False with every bound (NaN), and what is a number of the
wrong kind (``2.5`` steps); a string raised a raw ``TypeError`` from the comparison.
Each then misbehaved far from the setting: a NaN lease timeout took every worker's
leases back at every sweep, a NaN ``max_staleness`` bounded nothing, a NaN trial count
ran a study that never started a trial. Numpy's numbers count as numbers.
"""

from __future__ import annotations

import math
import numbers

from clusterflow.errors import ConfigError

__all__ = ["listed", "seconds", "whole"]


def whole(name: str, value: object, *, least: int = 0, error: type[Exception] = ConfigError) -> int:
    """``value`` as an int, if it is an integer (not a bool) of at least ``least``.

    Raises:
        error: naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise error(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def seconds(
    name: str, value: object, *, zero: bool = False, error: type[Exception] = ConfigError
) -> float:
    """``value`` as a float, if it is a finite number of seconds above zero (or zero
    itself, where ``zero``: "at once").

    Raises:
        error: naming ``name`` and the value.
    """
    kind = "a finite number of seconds >= 0" if zero else "a positive, finite number of seconds"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be {kind}, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and (number > 0 or (zero and number == 0))):
        raise error(f"{name} must be {kind}, got {value!r}")
    return number


def listed(name: str, value: object, what: str, *, error: type[Exception] = ConfigError) -> None:
    """Refuses a string where a list of ``what`` belongs: iterated, each character would
    be one (``command="python x.py"`` ran the program ``p``).

    Raises:
        error: naming ``name`` and the value.
    """
    if isinstance(value, str | bytes):
        raise error(f"{name} must be a list of {what}, got the string {value!r}")
