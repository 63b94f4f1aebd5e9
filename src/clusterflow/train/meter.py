"""Samples per second over a short sliding window.

A run's average since its start hides what users look at the figure for (a slow worker,
a stall), and a per-step figure jumps with every step's noise; a window of about a
second follows changes while staying readable.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["Throughput"]

WINDOW_S = 2.0
"""Seconds of history the rate is computed over."""
MAX_POINTS = 256
"""At most this many steps are remembered, so a very fast loop costs bounded memory."""


class Throughput:
    """Samples per second over the last ``window_s`` seconds of steps.

    Args:
        window_s: how far back the rate looks.
        clock: seconds, monotonic; injectable for tests.
    """

    def __init__(
        self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window = window_s
        self._clock = clock
        self._total = 0
        self._points: deque[tuple[float, int]] = deque(maxlen=MAX_POINTS)
        self._points.append((clock(), 0))

    def restart(self) -> None:
        """Forgets the history: the time before (restoring, compiling) is not training."""
        self._points.clear()
        self._points.append((self._clock(), self._total))

    def add(self, samples: int) -> float | None:
        """Records a step of ``samples``; returns the current rate (None until measurable)."""
        now = self._clock()
        self._total += samples
        points = self._points
        points.append((now, self._total))
        while len(points) > 2 and now - points[1][0] >= self._window:
            points.popleft()
        start_t, start_n = points[0]
        elapsed = now - start_t
        return (self._total - start_n) / elapsed if elapsed > 0 else None
