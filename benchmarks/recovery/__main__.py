"""Recovery time and checkpoint cost (issue: fault tolerance).

* ``worker_respawn_s``: an asynchronous parameter-server cluster (1 ps, 2 workers). The
  job process of ``worker:1`` is SIGKILLed; the figure is the time from the kill to the
  first update the respawned worker has applied (its first line in ``steps.log``, which
  ``job.py`` writes after each applied push). Median over the trials. Each
  trial starts from a steady state: training runs and the manager's standby supervisor
  (a warm Python with torch imported, ``backends/zygote.py``) is ready.
* ``full_restart_s``: MultiWorkerMirroredStrategy on 2 workers under
  ``--warm-restarts``, checkpointing every 10 steps. Each trial starts from a steady
  state with a warm standby per task; the job of ``worker:0`` is SIGKILLed; the manager
  stops every task and restarts them all from the last committed checkpoint; the figure
  is the time from the kill to the first step of the new incarnation (a line with the
  next attempt number). The same without ``--warm-restarts`` (every task started cold)
  is printed beside it, ``cold restart (s)``. These have no peer: each prints as the
  median over trials with the smallest and largest.
* ``checkpoint_vs_torch_save``: one process, a 64 MiB MLP. A consistent checkpoint
  (``Checkpointer.save``: the model part, the task's own part, the manifest, all fsynced)
  against ``torch.save`` of the same state dict to a file in the same folder, in
  alternating rounds (order reversed each round); the median over rounds of each
  round's ratio, with the smallest and largest (below 1: the checkpoint is faster).
  ``checkpoint_vs_torch_save_fsync`` compares with ``torch.save`` followed by ``fsync``,
  the same durability as the checkpoint's.

Goals: respawn at most 3 s, full restart at most 10 s, checkpoint at most 1.5x.

With ``--verbose``, where each recovery's time goes, phase by phase (the medians over
the trials), from the kill's instant, the manager's events (``events.jsonl``) and the
job's own marks (``job.py``'s ``phases.log``):

* a respawn: ``detect`` (the kill to the manager recording the exit), ``decide`` (to its
  ``task_respawned``: the old launch killed, its leases returned), ``hand`` (to
  ``standby_took_over``: the ps fenced, the checkpoint chosen), ``register`` (to the
  new address's ``spec_updated``), ``start`` (to the job's first line running in the
  zygote), ``strategy`` (to the strategy and model built), ``restore`` (nothing to
  restore here), ``first_step`` (to its first applied update);
* a whole restart (``restart`` warm, ``cold_restart`` cold): ``detect``, ``stop`` (to
  ``cluster_restarted``: every task killed, a fresh store), ``tasks`` (to
  ``spec_assembled``: the supervisors started, or the standbys handed the tasks, and
  registered), then the latest task's ``spawn`` (to its job's first line), ``imports``
  (torch), ``strategy`` (the process group joined), ``restore`` (the checkpoint read)
  and ``first_step``.

    python -m benchmarks.recovery [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from benchmarks.common import (
    MachineLoad,
    Spread,
    alternate,
    parser,
    ratio,
    report,
    timed,
)
from clusterflow.testing.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "benchmarks" / "recovery" / "job.py"
CLI = [sys.executable, "-m", "clusterflow.cli.main"]
TIMEOUT_S = 120.0


def _wait(predicate: Callable[[], object], what: str, timeout: float = TIMEOUT_S) -> object:
    """``testing.waiting.wait_for``, polled every 10 ms (the poll bounds the figures'
    resolution); a wait that runs out ends the benchmark with one line."""
    try:
        return wait_for(predicate, what, timeout, poll_s=0.01)
    except TimeoutError as exc:
        raise SystemExit(f"benchmark failed: {exc}") from None


class Cluster:
    """A detached cluster in a private CLUSTERFLOW_HOME, stopped on exit."""

    def __init__(self, home: Path, out: Path, args: list[str], mode: str) -> None:
        self.home, self.out = home, out
        self.env = {**os.environ, "CLUSTERFLOW_HOME": str(home)}
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "src"), self.env.get("PYTHONPATH", "")]
        )
        job = [sys.executable, str(JOB), mode, str(out)]
        done = subprocess.run(
            [*CLI, "start", "--detach", "--max-restarts", "50", *args, "--", *job],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
        )
        if done.returncode:
            raise SystemExit(f"benchmark failed: clusterflow start: {done.stderr.strip()}")
        self.id = done.stdout.strip()

    def state(self) -> dict[str, object]:
        path = self.home / "clusters" / self.id / "state.json"
        data: dict[str, object] = json.loads(path.read_text())
        return data

    def lines(self) -> list[list[str]]:
        path = self.out / "steps.log"
        if not path.exists():
            return []
        return [line.split() for line in path.read_text().splitlines() if line.count(" ") == 3]

    def job_pid(self, task: str) -> int | None:
        for entry in self.state().get("tasks") or []:  # type: ignore[attr-defined]
            if entry.get("task") == task and entry.get("exit_code") is None:
                try:
                    children = psutil.Process(entry["pid"]).children()
                except psutil.Error:
                    return None
                return children[0].pid if children else None
        return None

    def events(self) -> list[dict[str, object]]:
        path = self.home / "clusters" / self.id / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def marks(self) -> list[list[str]]:
        """``task attempt NAME wall_time`` lines of the job's ``phases.log``."""
        path = self.out / "phases.log"
        if not path.exists():
            return []
        return [line.split() for line in path.read_text().splitlines() if line.count(" ") == 3]

    def stop(self) -> None:
        subprocess.run([*CLI, "stop", self.id], capture_output=True, env=self.env, check=False)


RESPAWN_PHASES = (
    "detect",
    "decide",
    "hand",
    "register",
    "start",
    "strategy",
    "restore",
    "first_step",
)
RESTART_PHASES = (
    "detect",
    "stop",
    "tasks",
    "spawn",
    "imports",
    "strategy",
    "restore",
    "first_step",
)
PROFILE: dict[str, dict[str, list[float]]] = {"respawn": {}, "restart": {}, "cold_restart": {}}
"""Each recovery's phases (module docstring), per trial, for ``--verbose``."""


def _event_after(events: list[dict[str, object]], name: str, after: float, **match: str) -> float:
    """The time of the first ``name`` event at or after ``after`` whose fields match."""
    for event in events:
        at = float(event["time"])  # type: ignore[arg-type]
        if (
            event["event"] == name
            and at >= after
            and all(event.get(k) == v for k, v in match.items())
        ):
            return at
    raise SystemExit(f"benchmark failed: no {name} event {match} after the kill")


def _profile(kind: str, names: tuple[str, ...], marks: list[float]) -> None:
    """Records one trial's phases: the gaps between consecutive instants of ``marks``
    (one more than ``names``)."""
    assert len(marks) == len(names) + 1
    for name, begin, end in zip(names, marks, marks[1:], strict=False):
        PROFILE[kind].setdefault(name, []).append(end - begin)


def worker_respawns(trials: int, workdir: Path) -> list[float]:
    out = workdir / "async"
    out.mkdir()
    cluster = Cluster(workdir / "home-async", out, ["--ps", "1", "--workers", "2"], "async")
    times = []
    try:
        for _ in range(trials):
            # Steady state: training, and the manager's standby supervisor warm (a cluster
            # that has run a while has one; a second death within its warm-up costs more).
            _wait(
                lambda: (
                    len(cluster.lines()) > 40
                    and cluster.job_pid("worker:1")
                    and (cluster.state().get("standby") or {}).get("ready")
                ),  # type: ignore[attr-defined]
                "steps and a warm standby",
            )
            pid = cluster.job_pid("worker:1")
            assert pid is not None
            seen = {line[1] for line in cluster.lines() if line[0] == "worker:1"}
            killed = time.time()
            os.kill(pid, signal.SIGKILL)

            def first_new(seen: set[str] = seen) -> float | None:
                news = [
                    float(line[3])
                    for line in cluster.lines()
                    if line[0] == "worker:1" and line[1] not in seen
                ]
                return min(news) if news else None

            first = float(_wait(first_new, "update from the respawned worker"))  # type: ignore[arg-type]
            times.append(first - killed)
            events = cluster.events()
            exited = _event_after(events, "task_exited", killed, task="worker:1")
            respawned = _event_after(events, "task_respawned", exited, task="worker:1")
            took = _event_after(events, "standby_took_over", respawned, task="worker:1")
            moved = _event_after(events, "spec_updated", took, task="worker:1")
            job = {
                m[2]: float(m[3])
                for m in cluster.marks()
                if m[0] == "worker:1" and float(m[3]) >= took
            }
            _profile(
                "respawn",
                RESPAWN_PHASES,
                [
                    killed,
                    exited,
                    respawned,
                    took,
                    moved,
                    job["started"],
                    job["strategy"],
                    job["restored"],
                    first,
                ],
            )
            # The next trial starts from a steady state again.
            count = len(cluster.lines())
            _wait(lambda n=count: len(cluster.lines()) > n + 40, "steps")
    finally:
        cluster.stop()
    return times


def full_restarts(trials: int, workdir: Path, *, warm: bool) -> list[float]:
    """``warm``: under ``--warm-restarts``, each trial from a steady state with a warm
    standby per task (as ``worker_respawns`` waits for its standby)."""
    out = workdir / ("allreduce-warm" if warm else "allreduce")
    out.mkdir()
    flags = ["--workers", "2", *(["--warm-restarts"] if warm else [])]
    cluster = Cluster(workdir / f"home-{out.name}", out, flags, "allreduce")
    kind = "restart" if warm else "cold_restart"
    times = []

    def standbys_warm() -> bool:
        standby = cluster.state().get("standby") or {}
        return not warm or standby.get("ready_count") == 2  # type: ignore[union-attr]

    try:
        for attempt in range(trials):
            _wait(
                lambda a=attempt: (
                    sum(1 for line in cluster.lines() if line[2] == str(a)) > 40
                    and cluster.job_pid("worker:0")
                    and standbys_warm()
                ),
                "steps" + (" and a warm standby per task" if warm else ""),
            )
            pid = cluster.job_pid("worker:0")
            assert pid is not None
            killed = time.time()
            os.kill(pid, signal.SIGKILL)

            def first_of_next(a: int = attempt) -> float | None:
                news = [float(line[3]) for line in cluster.lines() if line[2] == str(a + 1)]
                return min(news) if news else None

            first = float(_wait(first_of_next, "step after the restart"))  # type: ignore[arg-type]
            times.append(first - killed)
            events = cluster.events()
            exited = _event_after(events, "task_exited", killed, task="worker:0")
            restarted = _event_after(events, "cluster_restarted", exited)
            assembled = _event_after(events, "spec_assembled", restarted)
            latest: dict[str, float] = {}
            for _task, incarnation, name, at in cluster.marks():
                if incarnation == str(attempt + 1):
                    latest[name] = max(latest.get(name, 0.0), float(at))
            _profile(
                kind,
                RESTART_PHASES,
                [
                    killed,
                    exited,
                    restarted,
                    assembled,
                    latest["started"],
                    latest["imported"],
                    latest["strategy"],
                    latest["restored"],
                    first,
                ],
            )
    finally:
        cluster.stop()
    return times


def checkpoint_cost(rounds: int, workdir: Path, verbose: bool) -> tuple[Spread, Spread, int]:
    """Per round, a checkpoint's seconds / ``torch.save``'s, and / ``torch.save`` + fsync."""
    import torch
    from torch import nn

    from clusterflow.train.cut import Checkpointer

    torch.manual_seed(0)
    # 4096*4096 + 4096 + 4096*4 + 4 floats: 64.1 MiB of parameters.
    model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    directory = workdir / "checkpoints"
    ckpt = Checkpointer(model=model, directory=str(directory), keep=2)
    steps = itertools.count(1)

    def ours() -> float:
        return timed(lambda: ckpt.save(next(steps)))

    def plain() -> float:
        return timed(lambda: torch.save(model.state_dict(), directory / "torch-plain.pt"))

    def synced() -> float:
        def save() -> None:
            path = directory / "torch-synced.pt"
            torch.save(model.state_dict(), path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        return timed(save)

    times = alternate({"ours": ours, "plain": plain, "synced": synced}, rounds, verbose=verbose)
    ms = {name: Spread.of(values).median * 1e3 for name, values in times.items()}
    print(
        f"checkpoint of {nbytes / 2**20:.1f} MiB, medians: {ms['ours']:.0f} ms; torch.save "
        f"{ms['plain']:.0f} ms, with fsync {ms['synced']:.0f} ms",
        flush=True,
    )
    return ratio(times["ours"], times["plain"]), ratio(times["ours"], times["synced"]), nbytes


def main() -> None:
    args = parser("recovery", __doc__).parse_args()
    trials = args.rounds or (3 if args.quick else 7)
    with tempfile.TemporaryDirectory(prefix="cf-recovery-") as tmp:
        workdir = Path(tmp)
        # The clusters run detached, outside this process's tree: theirs by their home.
        load = MachineLoad(lambda p: p.environ().get("CLUSTERFLOW_HOME", "").startswith(tmp))
        vs_save, vs_synced, _ = checkpoint_cost(
            max(trials, 8 if args.quick else 20), workdir, args.verbose
        )
        respawn = worker_respawns(trials, workdir)
        print("worker respawn (s): " + " ".join(f"{t:.2f}" for t in respawn), flush=True)
        restart = full_restarts(trials, workdir, warm=True)
        print("full restart (s):   " + " ".join(f"{t:.2f}" for t in restart), flush=True)
        cold = full_restarts(trials, workdir, warm=False)
        print(
            "cold restart (s), without --warm-restarts: "
            + " ".join(f"{t:.2f}" for t in cold)
            + f"; median {Spread.of(cold)}",
            flush=True,
        )
        described = load.describe()
    if args.verbose:
        for kind, phases in PROFILE.items():
            print(
                f"{kind} by phase, seconds: "
                + ", ".join(f"{name} {Spread.of(values)}" for name, values in phases.items()),
                flush=True,
            )
    figures = {
        "worker_respawn_s": Spread.of(respawn),
        "full_restart_s": Spread.of(restart),
        "checkpoint_vs_torch_save": vs_save,
        "checkpoint_vs_torch_save_fsync": vs_synced,
    }
    report("recovery", figures, described)


if __name__ == "__main__":
    main()
