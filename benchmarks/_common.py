"""Shared helpers: argument parsing, timing, and the single RESULT line."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc)
    p.add_argument("--quick", action="store_true", help="a run of under a minute")
    return p


def best_of(fn: Callable[[], float], repeats: int) -> float:
    """The smallest of ``repeats`` timings: the least disturbed by the other core's work."""
    return min(fn() for _ in range(repeats))


def median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def result(name: str, **figures: float) -> None:
    """Prints the RESULT line every benchmark ends with (docs/architecture.md section 8)."""
    parts = " ".join(f"{k}={v:.3f}" for k, v in figures.items())
    print(f"RESULT {name} {parts}", flush=True)
