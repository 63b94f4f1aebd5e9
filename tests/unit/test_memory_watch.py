"""``backends/memory_watch``: a task's peak memory, its limit, and kills for memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from clusterflow.backends.memory_watch import MemoryWatch, oom_kills, tree_rss


def vmstat(path: Path, kills: int) -> Path:
    path.write_text(f"nr_free_pages 1000\noom_kill {kills}\npgfault 5\n")
    return path


def test_the_peak_is_the_largest_sample_and_the_first_sample_over_the_limit_kills() -> None:
    watch = MemoryWatch(100.0, vmstat=Path("/nonexistent"))
    assert [watch.sample(n) for n in (50, 90, 101, 150, 20)] == [False, False, True, False, False]
    assert watch.peak == 150 and watch.over
    assert watch.killed_for_memory(-9) and watch.killed_for_memory(1)


def test_without_a_limit_nothing_is_over() -> None:
    watch = MemoryWatch(None, vmstat=Path("/nonexistent"))
    assert not watch.sample(10**12)
    assert not watch.killed_for_memory(-9)  # and no counter to read: not for memory


def test_a_sigkill_while_the_kernels_oom_killer_worked_was_for_memory(tmp_path: Path) -> None:
    stat = vmstat(tmp_path / "vmstat", 3)
    watch = MemoryWatch(10**9, vmstat=stat)
    assert not watch.killed_for_memory(-9)  # the counter has not moved
    vmstat(stat, 4)
    assert watch.killed_for_memory(-9)
    assert not watch.killed_for_memory(1)  # exited by itself: not the OOM killer
    assert not watch.killed_for_memory(None)  # still running


def test_oom_kills_reads_the_counter_or_none(tmp_path: Path) -> None:
    assert oom_kills(vmstat(tmp_path / "v", 7)) == 7
    (tmp_path / "w").write_text("nr_free_pages 1\n")
    assert oom_kills(tmp_path / "w") is None
    assert oom_kills(tmp_path / "missing") is None


def test_tree_rss_counts_the_children() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; b = b'1' * (64 << 20); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        me = psutil.Process(os.getpid())
        assert tree_rss(me) >= me.memory_info().rss + (64 << 20)
    finally:
        child.kill()
        child.wait()
