"""Shared helpers: arguments, alternating rounds, medians with their spread, the RESULT line.

Every benchmark measures ours and its peer in alternating rounds (never one phase after
the other), takes each round's ratio (both sides of a round ran under nearly the same
load from the rest of the machine), and reports the median over the rounds with the
smallest and largest: ``key=median key_min=... key_max=...``. On a shared two-core
machine a burst of other work can halve one window; it then moves one round's ratio, not
the median.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import psutil

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
BUSY = 0.1
"""Above this share of the CPU used by other processes, the report flags the run."""


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a run of about a minute or less")
    p.add_argument("--rounds", type=_positive, help="alternating rounds (default per benchmark)")
    p.add_argument("--verbose", action="store_true", help="print every round's figures")
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 3:
        raise argparse.ArgumentTypeError(f"--rounds must be at least 3, got {value}")
    return value


def run_ranks(
    worker: Callable[[int, int, Any, Connection | None], None], world: int, plan: Any
) -> Any:
    """Runs ``worker(rank, port, plan, conn)`` in ``world`` spawned processes and returns
    what rank 0 sends on ``conn`` (the others get None).

    The ranks meet at a ``TCPStore`` on ``port``, hosted here and joined as clients by
    every rank, as clusterflow's manager hosts one. Every rank still alive on the way out
    (one that hung, or this process interrupted) is killed.
    """
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=120), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [
        ctx.Process(target=worker, args=(rank, store.port, plan, child if rank == 0 else None))
        for rank in range(world)
    ]
    try:
        for proc in procs:
            proc.start()
        sent = parent.recv()
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    return sent


def one_thread_per_process() -> None:
    """Every process this benchmark starts from now on runs torch and BLAS on one thread.

    Two workers with torch's default of a thread per core each (plus a ps) would
    oversubscribe two cores, and each window would depend on where the scheduler put the
    threads. The workers also call ``torch.set_num_threads(1)``; the environment makes
    it hold from the import on, for every library, in every spawned child.
    """
    for name in THREAD_VARIABLES:
        os.environ[name] = "1"


def settle() -> None:
    """Collects garbage and moves everything alive to the permanent generation.

    Called after set-up and before the timed rounds. A guard, not a cure: measured, the
    training loops here trigger at most one young collection (0.5 ms) per 200 steps;
    but a full collection over torch's ~290k import-time objects would take tens of
    milliseconds and land in whichever window triggered it.
    """
    gc.collect()
    gc.freeze()


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of a figure over rounds, with the smallest and largest round."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        v = list(values)
        if not v:
            raise ValueError("a spread of no values")
        return cls(statistics.median(v), min(v), max(v), len(v))

    def __str__(self) -> str:
        return f"{self.median:.3g} ({self.low:.3g}-{self.high:.3g} over {self.count})"


def ratio(ours: list[float], peer: list[float]) -> Spread:
    """Per round, ``ours / peer``; their median and spread."""
    return Spread.of(a / b for a, b in zip(ours, peer, strict=True))


class MachineLoad:
    """How much of the machine's CPU processes outside this benchmark took meanwhile.

    Reads the kernel's busy time over all cores (``/proc/stat``, steal included) and
    subtracts the CPU time of this process and its descendants, sampled every
    ``interval`` seconds by a daemon thread (so a process that ended still counts up to
    its last sample). A figure taken while others used half the machine is a figure of
    a loaded machine; the report says so.
    """

    def __init__(
        self,
        also_ours: Callable[[psutil.Process], bool] | None = None,
        interval: float = 0.5,
    ) -> None:
        """``also_ours``: processes outside this one's tree that count as the benchmark's
        (a detached cluster's)."""
        self._me = psutil.Process()
        self._also = also_ours
        self._first: dict[tuple[int, float], float] = {}
        self._last: dict[tuple[int, float], float] = {}
        self._lock = threading.Lock()
        self._started = time.time()
        self._start = self._machine()
        self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="machine-load", daemon=True
        )
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._sample()

    def _sample(self) -> None:
        procs = {self._me, *self._me.children(recursive=True)}
        if self._also is not None:
            for proc in psutil.process_iter():
                try:
                    if self._also(proc):
                        procs.add(proc)
                except psutil.Error:
                    continue
        for proc in procs:
            try:
                with proc.oneshot():
                    key = (proc.pid, proc.create_time())
                    t = proc.cpu_times()
            except psutil.Error:
                continue
            cpu = t.user + t.system
            with self._lock:
                if key not in self._first:
                    # Present before we started: count from now; born since: from birth.
                    self._first[key] = cpu if key[1] < self._started else 0.0
                self._last[key] = cpu

    @staticmethod
    def _machine() -> tuple[float, float]:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        # guest time is already counted in user on Linux.
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        return total, total - idle

    def others(self) -> float:
        """The share (0-1) of all cores' time since construction used by other processes."""
        self._sample()
        total, busy = self._machine()
        t0, b0 = self._start
        with self._lock:
            ours = sum(self._last[k] - self._first[k] for k in self._last)
        if total <= t0:
            return 0.0
        return max(0.0, min(1.0, ((busy - b0) - ours) / (total - t0)))

    def describe(self) -> str:
        """One line for the report; also stops the sampling."""
        share = self.others()
        self._stop.set()
        line = (
            f"load: other processes used {share:.0%} of this machine's "
            f"{psutil.cpu_count()} cores' time during the run"
        )
        if share > BUSY:
            line += " (a busy machine: these are not a quiet machine's figures)"
        return line


def alternate(
    sides: Mapping[str, Callable[[], float]],
    rounds: int,
    *,
    verbose: bool = False,
    warmup: bool = True,
) -> dict[str, list[float]]:
    """Runs every side once per round, in an order reversed each round; their figures.

    One untimed call of each side first (caches, lazy set-up, the first connection).
    Reversing the order means no side always runs right after the same other side.
    """
    order = list(sides)
    if warmup:
        for name in order:
            sides[name]()
    settle()
    figures: dict[str, list[float]] = {name: [] for name in order}
    for i in range(rounds):
        for name in order:
            figures[name].append(sides[name]())
        order.reverse()
        if verbose:
            line = " ".join(f"{name}={values[-1]:.4g}" for name, values in figures.items())
            print(f"round {i}: {line}", flush=True)
    return figures


def best_of(fn: Callable[[], float], repeats: int) -> float:
    """The smallest of ``repeats`` back-to-back timings: the least disturbed by neighbours."""
    return min(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def result(name: str, **figures: float | Spread) -> None:
    """Prints the RESULT line every benchmark ends with (docs/architecture.md section 8).

    A ``Spread`` prints as ``key=median key_min=low key_max=high``.
    """
    parts = []
    for key, value in figures.items():
        if isinstance(value, Spread):
            parts += [
                f"{key}={value.median:.3f}",
                f"{key}_min={value.low:.3f}",
                f"{key}_max={value.high:.3f}",
            ]
        else:
            parts.append(f"{key}={value:.3f}")
    print(f"RESULT {name} {' '.join(parts)}", flush=True)


def report(name: str, figures: Mapping[str, Spread], load: str) -> None:
    """Ends a benchmark whose figures are all spreads: a line per figure, the machine's
    load over the run (``MachineLoad.describe``), then the RESULT line."""
    for key, spread in figures.items():
        print(f"{key}: {spread}")
    print(load, flush=True)
    result(name, **figures)
