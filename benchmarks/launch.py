"""Launch time: ``clusterflow start --workers 2`` against ``torchrun --nproc-per-node 2``.

One trial launches two workers running ``benchmarks/_launch_probe.py`` (which imports
torch and prints ``ready rank=<RANK>``) and times from just before the launcher is
started to the moment both ranks' lines have been read from the launcher's combined
stdout and stderr. Each round runs one trial of each launcher, in an order reversed each
round (after one untimed trial of each), so a drift of the machine touches both alike;
``time_ratio`` is the median over rounds of that round's clusterflow/torchrun ratio, with
the smallest and largest (below 1: clusterflow is faster).

Each launcher starts in a new session. After a trial it is left to exit by itself, then
its process group and every descendant seen during the trial are killed, and it is waited
for, so no trial's tear-down overlaps the next one's start.

    python -m benchmarks.launch [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import psutil

from benchmarks.common import MachineLoad, Spread, alternate, parser, ratio, result

ROOT = Path(__file__).resolve().parent.parent
PROBE = "benchmarks/_launch_probe.py"
WORKERS = 2
READY = re.compile(r"ready rank=(\d+)")
# Generous: a trial takes seconds; a launcher that hangs fails the run, not the machine.
TRIAL_TIMEOUT_S = 120.0
# Time a launcher gets to exit by itself once both ranks are ready (the probes exit at once).
EXIT_GRACE_S = 30.0


class TrialError(RuntimeError):
    """A launcher exited, or ran out of time, before both ranks printed their line."""


def _bin(name: str) -> str:
    # Next to sys.executable, not resolved: a venv's python is a link to the base one.
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise SystemExit(f"{path} not found: install the project into this venv first")
    return str(path)


def commands() -> dict[str, list[str]]:
    return {
        "clusterflow": [
            _bin("clusterflow"),
            "start",
            "--workers",
            str(WORKERS),
            "--",
            sys.executable,
            PROBE,
        ],
        "torchrun": [_bin("torchrun"), "--nproc-per-node", str(WORKERS), PROBE],
    }


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill(proc: subprocess.Popen[str], seen: list[psutil.Process]) -> None:
    """Kills the launcher's process group and every descendant seen, by their ids."""
    # torchrun starts each worker in a session of its own, out of reach of killpg.
    seen = seen + _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in seen:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def _read_lines(stream: IO[str], lines: queue.Queue[tuple[float, str] | None]) -> None:
    # The time is taken here, as each line arrives, not when the main thread wakes for it.
    for line in stream:
        lines.put((time.perf_counter(), line))
    lines.put(None)


def trial(cmd: list[str], env: dict[str, str] | None = None) -> float:
    """Seconds from launch until every rank has printed its ready line.

    Waits for that, then for the launcher to exit (at most EXIT_GRACE_S), then kills
    whatever of it is left and waits for it.

    Raises:
        TrialError: the launcher exited, or TRIAL_TIMEOUT_S passed, before every rank was
            ready; the error holds the end of its output.
    """
    seen: list[psutil.Process] = []
    lines: queue.Queue[tuple[float, str] | None] = queue.Queue()
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    assert proc.stdout is not None  # stdout=PIPE
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    ready_at: float | None = None
    output: list[str] = []
    ranks: set[str] = set()
    try:
        while ready_at is None:
            try:
                item = lines.get(timeout=max(0.0, start + TRIAL_TIMEOUT_S - time.perf_counter()))
            except queue.Empty:
                break
            if item is None:
                break
            at, line = item
            output.append(line)
            # Both ranks write to one pipe: their lines can arrive run together.
            ranks.update(m.group(1) for m in READY.finditer(line))
            if len(ranks) == WORKERS:
                ready_at = at
                seen.extend(_descendants(proc.pid))
        if ready_at is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=EXIT_GRACE_S)
    finally:
        _kill(proc, seen)
        proc.wait()
        reader.join(timeout=EXIT_GRACE_S)
        if reader.is_alive():
            # Closing a pipe under a blocked reader would block too; the thread is a daemon.
            print(f"warning: a process outside {cmd[0]}'s tree holds its output", file=sys.stderr)
        else:
            proc.stdout.close()
    if ready_at is None:
        tail = "".join(output[-20:])
        raise TrialError(f"{cmd[0]} exited {proc.returncode} before {WORKERS} ready lines:\n{tail}")
    return ready_at - start


def main() -> None:
    args = parser("launch", __doc__).parse_args()
    rounds = args.rounds or (5 if args.quick else 11)
    cmds = commands()
    load = MachineLoad()
    # Warm the page cache for torch's files so the first timed trial is not the odd one out.
    subprocess.run([sys.executable, PROBE], cwd=ROOT, check=True, capture_output=True)
    # Each clusterflow trial registers a cluster; keep them out of the user's ~/.clusterflow.
    with tempfile.TemporaryDirectory(prefix="clusterflow-bench-") as home:
        env = {**os.environ, "CLUSTERFLOW_HOME": home}
        times = alternate(
            {name: functools.partial(trial, cmd, env) for name, cmd in cmds.items()},
            rounds,
            verbose=args.verbose,
        )
    medians = {name: Spread.of(t).median for name, t in times.items()}
    time_ratio = ratio(times["clusterflow"], times["torchrun"])
    print(
        f"median of {rounds} rounds: clusterflow {medians['clusterflow']:.3f} s, "
        f"torchrun {medians['torchrun']:.3f} s; time_ratio {time_ratio}"
    )
    print(load.describe(), flush=True)
    result("launch", time_ratio=time_ratio)


if __name__ == "__main__":
    main()
