"""A wait on a condition, for the tests and the benchmarks alike: never a bare sleep.

``wait_for(predicate, what, timeout)`` polls until ``predicate()`` is true and returns
that value; past ``timeout`` it raises ``TimeoutError`` naming ``what``. The timeout is a
safety net for a hung cluster, not a measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], what: str, timeout: float, poll_s: float = 0.05) -> Any:
    """``predicate()``'s first true value, polled every ``poll_s``; ``TimeoutError``
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g}s")
        time.sleep(poll_s)
