"""Printing a growing file until a condition holds (``logs --follow``, ``attach``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

FOLLOW_POLL_S = 0.1


def print_file(path: Path, done: Callable[[], bool]) -> None:
    """Copies ``path`` to stdout, then keeps copying what is appended until ``done()``.

    ``done`` is checked only after the file had nothing new, and once more after it turns
    true, so the last lines written before the end are never lost.
    """
    out = sys.stdout.buffer
    while not path.exists():
        if done():
            return
        time.sleep(FOLLOW_POLL_S)
    with path.open("rb") as f:
        while True:
            chunk = f.read(1 << 16)
            if chunk:
                out.write(chunk)
                out.flush()
                continue
            if done():
                rest = f.read()
                if rest:
                    out.write(rest)
                    out.flush()
                return
            time.sleep(FOLLOW_POLL_S)
