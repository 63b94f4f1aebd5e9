"""Runs ``examples/gpt/train.py`` under a launcher and reads what it printed.

Shared by ``benchmarks.gpt`` and ``benchmarks.gpu``. Only the standard library is
imported here (the GPU machine may lack the benchmarks' other tools, psutil included),
and the ``clusterflow`` command is reached as ``python -m clusterflow.cli.main``, so a
checkout with ``PYTHONPATH=src`` and no installed entry point runs it.

Every launch is one child process group with its own time limit. On the limit the
group gets SIGINT (``clusterflow start`` stops its cluster on it), then SIGKILL, and
every cluster left in the run's ``CLUSTERFLOW_HOME`` is stopped: one slow part cannot
eat the time of the others, nor leave processes behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "gpt" / "train.py")
_THROUGHPUT = re.compile(r"throughput tokens_per_s ([0-9.eE+-]+)")
_FINAL = re.compile(r"final val_loss ([0-9.eE+-]+|nan) step (\d+)")
_EVAL = re.compile(r"eval step (\d+) val_loss ([0-9.eE+-]+|nan) elapsed_s ([0-9.]+)")
_BACKEND = re.compile(r"backend (\w+)")


@dataclass
class Run:
    """What one launch printed, read."""

    command: list[str]
    returncode: int | None
    seconds: float
    output: str
    timed_out: bool = False
    tokens_per_s: float | None = None
    """The sum of every task's ``throughput`` line: the chief's global figure for
    synchronous strategies, each worker's own tokens for async ps."""
    val_loss: float | None = None
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    """``(step, val_loss, elapsed_s)`` of each evaluation the chief printed."""
    backend: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def why(self) -> str:
        """One line saying how it failed (the last line of its output)."""
        if self.timed_out:
            return f"timed out after {self.seconds:.0f}s"
        lines = [line for line in self.output.splitlines() if line.strip()]
        return f"exit {self.returncode}: {lines[-1][:200] if lines else 'no output'}"

    def time_to_loss(self, target: float) -> float | None:
        """Seconds from the run's start to the first evaluation at or below ``target``."""
        for _, loss, elapsed in self.evals:
            if loss <= target:
                return elapsed
        return None


def environment(home: str, threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, str(REPO), env.get("PYTHONPATH")) if p)
    env["CLUSTERFLOW_HOME"] = home
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TF_CONFIG", None)
    for name in [k for k in env if k.startswith("CLUSTERFLOW_") and k != "CLUSTERFLOW_HOME"]:
        env.pop(name)
    if threads:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = str(threads)
    return env


def alone(args: Sequence[str], script: str = TRAIN) -> list[str]:
    return [sys.executable, script, *args]


def torchrun(nproc: int, args: Sequence[str]) -> list[str]:
    """torch's own launcher, as ``torchrun --standalone`` (a free port of its own)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        TRAIN,
        *args,
    ]


def clusterflow(
    args: Sequence[str], *, workers: int, ps: int = 0, script: str = TRAIN
) -> list[str]:
    """``clusterflow start`` in the foreground, through the module (no entry point needed)."""
    shape = ["--workers", str(workers), *(["--ps", str(ps)] if ps else [])]
    cli = [sys.executable, "-m", "clusterflow.cli.main", "start", *shape, "--"]
    return [*cli, *alone(args, script)]


def launch(command: list[str], *, home: str, timeout: float, threads: int | None = None) -> Run:
    """Runs ``command`` to its end or ``timeout`` seconds; never raises for its failure."""
    Path(home).mkdir(parents=True, exist_ok=True)
    env = environment(home, threads)
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        out = _stop_group(proc)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        stop_clusters(home)
    run = Run(command, proc.returncode, time.perf_counter() - start, out or "", timed_out)
    _read(run)
    return run


def _stop_group(proc: subprocess.Popen[str]) -> str:
    """SIGINT (clusterflow start stops its cluster), then SIGKILL after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=20)
        return out or ""
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        return out or ""


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop_clusters(home: str) -> None:
    """Stops every cluster still running in ``home`` (a launch cut short leaves one)."""
    env = environment(home)
    cli = [sys.executable, "-m", "clusterflow.cli.main"]
    try:
        listing = subprocess.run(
            [*cli, "ps"], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=30
        ).stdout
    except (subprocess.TimeoutExpired, OSError):
        return
    for line in listing.splitlines()[1:]:
        ident = line.split()[0] if line.split() else ""
        if re.fullmatch(r"[0-9a-f]{6,}", ident):
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run(
                    [*cli, "stop", ident, "--grace", "5"],
                    check=False,
                    cwd=REPO,
                    env=env,
                    capture_output=True,
                    timeout=30,
                )


def _read(run: Run) -> None:
    rates = [float(m) for m in _THROUGHPUT.findall(run.output)]
    run.tokens_per_s = sum(rates) if rates else None
    final = _FINAL.findall(run.output)
    if final:
        run.val_loss = float(final[0][0])
    run.evals = [(int(s), float(v), float(e)) for s, v, e in _EVAL.findall(run.output)]
    backend = _BACKEND.search(run.output)
    run.backend = backend.group(1) if backend else None
