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

With ``--verbose``, where clusterflow's time goes, phase by phase (the medians over its
trials), from the wall-clock instants of each trial and of its cluster's own records:

* ``cli``: the launcher's start to the cluster's folder (Python, the CLI's imports, the
  settings merged);
* ``manager``: the folder to the manager's ``starting`` event;
* ``tasks``: ``starting`` to ``spec_assembled`` (every task's supervisor started and
  registered at the barrier);
* ``job``: ``spec_assembled`` to both ranks' ready lines (each job's own start: the
  probe's process and its ``import torch``).

    python -m benchmarks.launch [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import contextlib
import functools
import json
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


PHASES = ("cli", "manager", "tasks", "job")

LAUNCHES: list[tuple[float, float]] = []
"""(launch, both ranks ready) in wall-clock seconds, per clusterflow trial, in order."""


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
    wall = time.time()
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
    if Path(cmd[0]).name == "clusterflow":
        LAUNCHES.append((wall, wall + ready_at - start))
    return ready_at - start


def phases(home: Path) -> dict[str, list[float]]:
    """Each clusterflow trial's phases (module docstring), from its cluster's folder."""
    clusters = []
    for folder in (home / "clusters").iterdir():
        state = json.loads((folder / "state.json").read_text())
        events = {}
        for line in (folder / "events.jsonl").read_text().splitlines():
            record = json.loads(line)
            events.setdefault(record["event"], float(record["time"]))
        clusters.append((float(state["created"]), events))
    clusters.sort(key=lambda c: c[0])
    out: dict[str, list[float]] = {name: [] for name in PHASES}
    # One cluster per clusterflow trial, the untimed first one too, in the same order.
    for (launched, ready), (created, events) in zip(LAUNCHES, clusters, strict=True):
        marks = [launched, created, events["starting"], events["spec_assembled"], ready]
        for name, begin, end in zip(PHASES, marks, marks[1:], strict=False):
            out[name].append(end - begin)
    return out


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
        if args.verbose:
            spent = {name: Spread.of(values) for name, values in phases(Path(home)).items()}
            print(
                "clusterflow's launch by phase, seconds: "
                + ", ".join(f"{name} {spread}" for name, spread in spent.items())
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
