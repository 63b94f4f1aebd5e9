"""Runs one script as every rank of a ``torch.distributed`` group on 127.0.0.1, each rank
a Python of its own (``RANK``, ``WORLD_SIZE``, ``MASTER_*`` in its environment, the
cluster's own variables left out), for the tests whose ranks write what they saw to
files (``pipeline_job.py``, ``shm_link_job.py``).

Why each rank gets a process group of its own and a file for its output:

* A rank may start processes of its own (``shm_link_job``'s stranger). Killing only the
  rank left such a grandchild alive after a failed run, holding the test's files and
  its worker's CPU; killing the rank's group takes everything it started.
* Ranks wait on each other. Read one at a time from pipes, a rank blocked writing to a
  full pipe could stall the others until the deadline; a file never fills, and what a
  rank printed before it hung is there to show in the failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kills ``proc``'s process group (the rank and whatever it started) and reaps it."""
    with contextlib.suppress(ProcessLookupError):  # the group is empty: all gone
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()  # not a group leader after all: the rank alone
    proc.wait()


def run_script_ranks(script: Path, args: list[str], world: int, timeout_s: float) -> list[str]:
    """Every rank's output, once all exited 0; fails naming each rank that did not.

    All ranks share one deadline, ``timeout_s`` from the start: ranks still running then
    fail the run, named with what they printed. Every rank's process group is killed on
    the way out (at the deadline, or when the caller is interrupted), so nothing a rank
    started outlives the run.
    """
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERFLOW_", "TF_CONFIG"))}
    end = time.monotonic() + timeout_s
    procs: list[subprocess.Popen[bytes]] = []
    running: list[int] = []
    with tempfile.TemporaryDirectory(prefix="script-ranks-") as tmp:
        outputs = [Path(tmp) / f"rank-{rank}.log" for rank in range(world)]
        try:
            for rank in range(world):
                with outputs[rank].open("wb") as out:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, str(script), *args],
                            env={
                                **env,
                                "RANK": str(rank),
                                "WORLD_SIZE": str(world),
                                "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": str(world),
                                "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(port),
                            },
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, end - time.monotonic()))
            running = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
        finally:
            for proc in procs:
                _kill_group(proc)
        logs = [path.read_text(errors="replace") for path in outputs]
    what = " ".join([script.name, *args])  # names the run even without arguments
    if running:
        tails = "\n".join(f"rank {rank}:\n{logs[rank][-3000:]}" for rank in running)
        raise AssertionError(
            f"{what}: ranks {running} still running after {timeout_s:g}s (killed):\n{tails}"
        )
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"{what}: rank {rank} failed:\n{log[-3000:]}"
    return logs
