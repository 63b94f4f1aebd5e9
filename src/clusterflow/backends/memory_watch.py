"""Watching a task's memory on its node: the peak of its process tree, and whether it
was killed for memory (over its request, or by the kernel's OOM killer).

Ray places a task by its ``memory`` resource but does not enforce it; a task over its
request crowds its node's other tasks until an OOM killer (Ray's, the kernel's, a
cgroup's) picks a victim, maybe another task. So the Ray backend's actor samples the
resident memory of the supervisor's whole process tree (``MemoryWatch.sample``) and
kills the tree once it outgrows the request: the failure is then the task's own, and it
is known to be about memory, so the manager restarts it with more instead of failing
the run. What the sampler cannot see (a burst between two samples that a cgroup limit
or the kernel ends first) is recognised by the kernel's OOM-kill counter: a tree killed
by SIGKILL while that counter moved was killed for memory.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

VMSTAT = Path("/proc/vmstat")
HEADROOM = 1.25
"""Measured peak x this: a run's peak varies with data and timing by some percent."""
FLOOR = float(256 << 20)
"""Never ask for less: the interpreter, torch and the supervisor need about this much."""


def tree_rss(root: psutil.Process, *, private: bool = False) -> int:
    """Resident bytes of ``root`` and every process below it (0 once it is gone).

    ``private``: only the pages each holds alone (its USS), for a tree forked from a
    warm server (``forkserver``): the pages it still shares with the server (torch's
    import, hundreds of MB) would otherwise count once per process, and they are the
    server's, not the task's."""
    total = 0
    with contextlib.suppress(psutil.Error):
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_full_info().uss if private else proc.memory_info().rss
    return total


def oom_kills(vmstat: Path = VMSTAT) -> int | None:
    """How many processes the kernel's OOM killer (a cgroup's limit included) has killed
    since boot (``oom_kill`` in ``/proc/vmstat``); None where the kernel does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    return None


class MemoryWatch:
    """The memory of one process tree against its limit (bytes; None: no limit).

    Args:
        limit: the task's request; a sample above it means the tree must be killed.
        vmstat: where the kernel's OOM-kill counter is read (tests give a file).
    """

    def __init__(self, limit: float | None, vmstat: Path = VMSTAT) -> None:
        self.limit = limit
        self.peak = 0
        """The largest sample so far (bytes)."""
        self.over = False
        """A sample was above the limit: the tree was (or is to be) killed for it."""
        self._vmstat = vmstat
        self._kills_at_start = oom_kills(vmstat)

    def sample(self, rss: int) -> bool:
        """Records one sample; True the first time it is over the limit (kill it now)."""
        self.peak = max(self.peak, rss)
        if self.limit and rss > self.limit and not self.over:
            self.over = True
            return True
        return False

    def killed_for_memory(self, exit_code: int | None) -> bool:
        """Whether a tree that ended with ``exit_code`` was killed for memory: by this
        watch, or by SIGKILL while the kernel's OOM killer was at work."""
        if self.over:
            return True
        if exit_code != -9:
            return False
        now = oom_kills(self._vmstat)
        return now is not None and self._kills_at_start is not None and now > self._kills_at_start


def within_run(
    asked: float, peak: float, *, before: float = 0.0, grown: bool = False, largest: float = 0.0
) -> float:
    """What an automatically sized job asks for at a later placement of the same run.

    Args:
        asked: what it asks for now (the first estimate, or a request a kill grew).
        peak: the largest peak of the job's tasks measured so far in this run.
        before: the job's peak measured by earlier runs (a run's first minutes may not
            reach it: a restart early in the run must not shrink below it).
        grown: a kill for memory grew ``asked``: never ask for less than that.
        largest: the largest node's memory (0: unknown), the most a request can be.

    Returns:
        The larger peak x ``HEADROOM`` (at least ``FLOOR``); ``asked`` while nothing was
        measured; never less than ``asked`` after a kill for memory.
    """
    peak = max(peak, before)
    if peak <= 0:
        return asked
    sized = max(FLOOR, peak * HEADROOM)
    if largest:
        sized = min(sized, largest)
    return max(sized, asked) if grown else sized
