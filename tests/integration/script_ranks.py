"""Runs one script as every rank of a ``torch.distributed`` group on 127.0.0.1, each rank
a Python of its own (``RANK``, ``WORLD_SIZE``, ``MASTER_*`` in its environment, the
cluster's own variables left out), for the tests whose ranks write what they saw to
files (``pipeline_job.py``, ``shm_link_job.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_script_ranks(script: Path, args: list[str], world: int, timeout_s: float) -> list[str]:
    """Every rank's output, once all exited 0; fails naming the first rank that did not.
    A rank still running after ``timeout_s`` (or when the caller is interrupted) is
    killed."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERFLOW_", "TF_CONFIG"))}
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world):
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
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"{' '.join(args)}: rank {rank} failed:\n{log[-3000:]}"
    return logs
