"""Hostile-condition scenarios that the tests and ``python -m benchmarks.hostile`` share.

Each module is one scenario on emulated hosts (``clusterflow.testing``), importable by
both sides and launched in its hosts as ``python -m benchmarks.scenarios.NAME``:

* ``lossy``: sync training on clean and on slow, lossy, reordering links.
* ``partition``: a worker cut off from its ps and its dispatcher, relaunched.
* ``start``: cuts from the manager under ``clusterflow start --backend hosts``.

They live here, not in ``src/clusterflow/testing``: a scenario trains (ps, data,
strategies, train), and the harness must stay beside every layer of the product
(tests/unit/test_layers.py); nor in a benchmark's private module, since tests import them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], what: str, timeout: float, poll_s: float = 0.05) -> Any:
    """``predicate()``'s first true value, polled; ``TimeoutError`` naming ``what`` after
    ``timeout`` seconds (a scenario's wait on a condition, never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g}s")
        time.sleep(poll_s)
