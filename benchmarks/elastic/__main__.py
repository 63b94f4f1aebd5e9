"""Elastic clusters (issue 32): growing a running all-reduce job, against torchrun's
elastic mode and against a fresh start; and what a run of resizes and kills loses.

Three sides, one trial of each per round, in an order reversed each round:

* ``ours``: ``clusterflow start --workers 2:4`` of ``job.py allreduce``
  (``MultiWorkerMirroredStrategy`` through ``fit`` with the data service); once rank 0
  has taken ``WARM_STEPS`` steps at 2 replicas, ``clusterflow scale ID --workers 4``.
  ``pause_s``: from just before the ``scale`` command is started to the first step any
  replica logs at 4 replicas (each replica logs the replicas in sync after each step).
  ``grown_steps_per_s``: rank 0's steps per second at 4, over ``RATE_STEPS`` steps after
  the first ``RATE_SKIP`` at 4.
* ``torchrun``: two torchrun agents (``--nnodes 2:4 --nproc-per-node 1``, a c10d
  rendezvous on this machine) of ``ddp_job.py``, plain DDP that saves a checkpoint every
  20 steps and loads the latest at its start; once rank 0 has taken ``WARM_STEPS``
  steps, two more agents. The running agents see them waiting (``num_nodes_waiting``,
  looked at every monitor interval), stop their workers, and all four rendezvous and
  start workers at world size 4. ``torchrun_pause_s``: from just before the new agents
  are started to the first step logged at world size 4.
* ``fresh``: ``clusterflow start --workers 4`` of the same job. ``fresh_start_s``: from
  just before the command to the first step; ``fresh_steps_per_s`` as above.

Also printed: each side's start (``start_s``, ``torchrun_start_s``: launch to the first
step at 2), and ``steps_gained`` / ``torchrun_steps_gained``: how far the run moved on
between the request and the first step at 4 (ours: the survivors' steps meanwhile;
torchrun: its workers' steps until the agents stopped them, less the steps since its
last checkpoint, which it takes again). With
``--verbose``, every trial's figures and where each side's pause went (``PHASES``).

``pause_vs_torchrun`` = ``pause_s / torchrun_pause_s`` and ``pause_vs_fresh`` =
``pause_s / fresh_start_s`` per round, ``grown_vs_fresh`` = ``grown_steps_per_s /
fresh_steps_per_s`` per round; the median over rounds with the smallest and largest.

torchrun's settings are the shortest that work (``TORCHRUN_SETTINGS``, printed). Its
default shares the agents' TCP store with the workers, and then a grown job never
starts: the agent that was rank 0 keeps the bootstrap address of its first round and
does not write ``MASTER_ADDR`` under the new round's prefix, so a new agent waits for
it (``RendezvousStoreInfo.build``) and the others for the new agent's ``role_info`` or
their ``assigned_ranks``, until the store's 60 s timeout (docs/benchmarks.md, "Elastic").
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` has every round publish its own address.

``records_lost`` and ``records_duplicated``: one run of ``job.py records`` (an
asynchronous ``ParameterServerStrategy`` through ``fit`` with the data service, on a
model whose parameter ``i`` counts the updates of record ``i``) under ``--chief --ps 1
--workers 2:4 --max-restarts 0``, paced so every change lands mid-run: grow to 4, kill
a newcomer (it leaves: above MIN, no restart), shrink to 2, grow to 4, kill an original
worker, shrink to 2, then to the end. Lost: the record applications missing from
``EPOCHS`` per record; duplicated: those beyond it.

    python -m benchmarks.elastic [--quick] [--rounds N] [--verbose]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from benchmarks.common import (
    MachineLoad,
    Spread,
    alternate,
    one_thread_per_process,
    parser,
    ratio,
    result,
)
from clusterflow.testing.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "benchmarks" / "elastic"
JOB = HERE / "job.py"
DDP_JOB = HERE / "ddp_job.py"
CLI = [sys.executable, "-m", "clusterflow.cli.main"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT_S = 120.0
"""A safety net for a hung side, not a measurement."""
POLL_S = 0.01
"""The waits' poll: it bounds the figures' resolution."""
WARM_STEPS = 40
"""Rank 0's steps at 2 replicas before the resize: past the peer's first checkpoint
(every 20 steps), so its restart resumes as a real job's would."""
RATE_SKIP, RATE_STEPS = 20, 100
MARK = "CLUSTERFLOW_ELASTIC_BENCH"
"""Set on every torchrun agent (and inherited by its workers): what to kill after a
trial. torchrun starts each worker in a session of its own, out of reach of killpg."""

TORCHRUN_SETTINGS = {
    "monitor_interval": "0.1",
    "join_timeout": "30",
    "last_call_timeout": "1",
    "close_timeout": "10",
}
"""``last_call_timeout`` 1: the smallest torch takes (whole seconds, above 0); the wait
after MIN agents joined, paid by the first start and by a round the fourth agent
reaches late. ``monitor_interval`` 0.1 (torchrun's default): how often a running agent
looks for waiting nodes. ``join_timeout`` and ``close_timeout`` bound a failed
rendezvous only; a working one never waits for them."""


def _wait(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    """``wait_for``; a wait that runs out ends the benchmark with one line."""
    try:
        return wait_for(predicate, what, timeout, poll_s=POLL_S)
    except TimeoutError as exc:
        raise SystemExit(f"benchmark failed: {exc}") from None


@dataclass
class StepLog:
    """``OUT/steps.log`` (``WHO STEP WORLD WALL_TIME`` per line), read as it grows."""

    path: Path
    times: dict[tuple[str, int], list[float]] = field(default_factory=lambda: defaultdict(list))
    first: dict[int, float] = field(default_factory=dict)
    """The earliest step of any replica at each world size."""
    first_step: dict[int, int] = field(default_factory=dict)
    """The number of that step."""
    steps: dict[str, list[tuple[float, int]]] = field(default_factory=lambda: defaultdict(list))
    """Per replica, ``(time, step number)`` of every step."""
    _offset: int = 0

    def poll(self) -> StepLog:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self
        end = data.rfind(b"\n") + 1  # whole lines only: a writer may be mid-line
        self._offset += end
        for line in data[:end].decode().splitlines():
            who, step, world, at = line.split()
            t, w = float(at), int(world)
            self.times[who, w].append(t)
            self.steps[who].append((t, int(step)))
            if t < self.first.get(w, float("inf")):
                self.first[w], self.first_step[w] = t, int(step)
        return self

    def count(self, who: str, world: int) -> int:
        return len(self.poll().times[who, world])

    def first_at(self, world: int) -> float | None:
        return self.poll().first.get(world)

    def gained(self, who: str, asked: float) -> int:
        """Steps the run moved on between ``asked`` and its first step at 4: the first
        step at 4's number, less one, less ``who``'s last step before ``asked``. Under
        torchrun the steps since its last checkpoint are lost: the first step at 4
        follows the checkpoint."""
        before = max(step for t, step in self.poll().steps[who] if t <= asked)
        return self.first_step[4] - 1 - before

    def rate(self, who: str, world: int) -> float:
        """``who``'s steps per second at ``world`` over ``RATE_STEPS`` steps after the
        first ``RATE_SKIP``; waits for them."""
        _wait(lambda: self.count(who, world) > RATE_SKIP + RATE_STEPS, f"steps of {who}")
        t = self.times[who, world]
        return RATE_STEPS / (t[RATE_SKIP + RATE_STEPS] - t[RATE_SKIP])


PHASES = ("spawn", "imports", "join", "first_step")
"""Where a start goes, from the jobs' ``marks.log``: the request to the process's
creation; to torch and clusterflow imported; to the strategy built (a newcomer admitted
to the running group; under torchrun, the process group formed); to the first step at
4. Each mark is the latest over the processes the first step at 4 waited for."""


def phases(out: Path, asked: float, at4: float, tasks: set[str] | None) -> dict[str, float]:
    """The start's phases (``PHASES``) from ``OUT/marks.log``: marks after ``asked`` of
    ``tasks`` (None: every task)."""
    latest: dict[str, float] = {}
    for line in (out / "marks.log").read_text().splitlines():
        who, what, at = line.split()
        if tasks is not None and who not in tasks:
            continue
        when = float(at)
        if what == "created" and tasks is not None:
            # A newcomer a warm standby took was created before the request: no spawn.
            when = max(when, asked)
        elif when < asked - 0.1:
            continue
        latest[what] = max(latest.get(what, 0.0), when)
    marks = [asked, latest["created"], latest["imported"], latest["joined"], at4]
    return {f"{name}_s": b - a for name, a, b in zip(PHASES, marks, marks[1:], strict=False)}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env.pop("TF_CONFIG", None)
    for name in [k for k in env if k.startswith("CLUSTERFLOW_")]:
        env.pop(name)
    env.update(extra)
    return env


class Cluster:
    """A detached cluster of ``job.py MODE`` in the run's CLUSTERFLOW_HOME."""

    def __init__(self, home: Path, out: Path, args: list[str], mode: str) -> None:
        self.home, self.out = home, out
        self.env = _env(CLUSTERFLOW_HOME=str(home))
        done = subprocess.run(
            [*CLI, "start", "--detach", *args, "--", sys.executable, str(JOB), mode, str(out)],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
        )
        if done.returncode:
            raise SystemExit(f"benchmark failed: clusterflow start: {done.stderr.strip()}")
        self.id = done.stdout.strip()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args], capture_output=True, text=True, env=self.env, check=False
        )

    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(
            (self.home / "clusters" / self.id / "state.json").read_text()
        )
        return data

    def scale(self, workers: int) -> str:
        done = self.cli("scale", self.id, "--workers", str(workers))
        if done.returncode:
            raise SystemExit(f"benchmark failed: clusterflow scale: {done.stderr.strip()}")
        return done.stdout.strip()

    def job_pid(self, task: str) -> int:
        """The pid of ``task``'s job (its supervisor's child), once it runs."""

        def find() -> int | None:
            for entry in self.state().get("tasks") or []:
                if entry.get("task") == task and entry.get("pid"):
                    with contextlib.suppress(psutil.Error):
                        children = psutil.Process(entry["pid"]).children()
                        return children[0].pid if children else None
            return None

        pid: int = _wait(find, f"the job of {task}")
        return pid

    def stop(self) -> None:
        self.cli("stop", self.id, "--grace", "5")

    @contextlib.contextmanager
    def stopped(self) -> Iterator[Cluster]:
        """Stops the cluster on the way out; when the body failed, first prints the end
        of its output and of its step log (what the trial was waiting for)."""
        try:
            yield self
        except BaseException:
            output = self.cli("logs", self.id).stdout.splitlines()
            steps = self.out / "steps.log"
            tail = steps.read_text().splitlines()[-5:] if steps.exists() else []
            print("\n".join(["cluster output:", *output[-40:], "steps.log:", *tail]))
            raise
        finally:
            self.stop()


# The sides ---------------------------------------------------------------------------


@dataclass
class Trials:
    """Every trial's figures, by name, in the order taken (the untimed first one too)."""

    figures: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, verbose: bool, side: str, **figures: float) -> None:
        for name, value in figures.items():
            self.figures[name].append(value)
        if verbose:
            shown = " ".join(f"{k}={v:.3g}" for k, v in figures.items())
            print(f"  {side}: {shown}", flush=True)

    spent: dict[str, list[dict[str, float]]] = field(default_factory=lambda: defaultdict(list))
    """Per side, each trial's ``phases``."""

    def phases(self, side: str, spent: dict[str, float]) -> None:
        self.spent[side].append(spent)

    def last(self, name: str, rounds: int) -> list[float]:
        return self.figures[name][-rounds:]

    def where(self, side: str, rounds: int) -> str:
        """The medians of a side's phases over its timed trials, as one line."""
        trials = self.spent[side][-rounds:]
        return ", ".join(f"{name} {Spread.of(t[f'{name}_s'] for t in trials)}" for name in PHASES)


def grow(workdir: Path, trials: Trials, verbose: bool) -> float:
    """One ``ours`` trial; returns ``pause_s``."""
    out = Path(tempfile.mkdtemp(prefix="grow-", dir=workdir))
    log = StepLog(out / "steps.log")
    began = time.time()
    with Cluster(workdir / "home", out, ["--workers", "2:4"], "allreduce").stopped() as cluster:
        _wait(lambda: log.count("worker:0", 2) >= WARM_STEPS, "steps at 2 replicas")
        start_s = float(log.first_at(2) or 0.0) - began
        asked = time.time()
        scaler = subprocess.Popen(
            [*CLI, "scale", cluster.id, "--workers", "4"],
            env=cluster.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            at4 = float(_wait(lambda: log.first_at(4), "step at 4 replicas"))
            rate = log.rate("worker:0", 4)
            said, _ = scaler.communicate(timeout=TIMEOUT_S)
        finally:
            if scaler.poll() is None:
                scaler.kill()
                said, _ = scaler.communicate()
                print(f"clusterflow scale, still running, said: {said.strip()}")
        if scaler.returncode:
            raise SystemExit(f"benchmark failed: clusterflow scale: {said.strip()}")
    pause = at4 - asked
    spent = phases(out, asked, at4, set(added(said)))
    trials.add(
        verbose,
        "ours",
        start_s=start_s,
        pause_s=pause,
        steps_gained=log.gained("worker:0", asked),
        grown_steps_per_s=rate,
    )
    trials.phases("ours", spent)
    return pause


def fresh(workdir: Path, trials: Trials, verbose: bool) -> float:
    """One ``fresh`` trial; returns ``fresh_start_s``."""
    out = Path(tempfile.mkdtemp(prefix="fresh-", dir=workdir))
    log = StepLog(out / "steps.log")
    began = time.time()
    with Cluster(workdir / "home", out, ["--workers", "4"], "allreduce").stopped():
        at4 = float(_wait(lambda: log.first_at(4), "step at 4 replicas"))
        rate = log.rate("worker:0", 4)
    start = at4 - began
    trials.add(verbose, "fresh", fresh_start_s=start, fresh_steps_per_s=rate)
    trials.phases("fresh", phases(out, began, at4, None))
    return start


def torchrun_command(port: int, run_id: str, out: Path) -> list[str]:
    s = TORCHRUN_SETTINGS
    conf = ",".join(f"{k}={s[k]}" for k in ("join_timeout", "last_call_timeout", "close_timeout"))
    return [
        *TORCHRUN,
        "--nnodes",
        "2:4",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "10",
        "--monitor-interval",
        s["monitor_interval"],
        "--rdzv-conf",
        conf,
        str(DDP_JOB),
        str(out),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _kill_marked(tag: str) -> None:
    """SIGKILLs every process that carries ``MARK=tag`` (the trial's agents and workers),
    until none is left (an agent killed mid-restart starts no more)."""
    while True:
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(MARK) == tag:
                    found.append(proc)
        if not found:
            return
        for proc in found:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(found, timeout=10)


def torchrun(workdir: Path, trials: Trials, verbose: bool) -> float:
    """One ``torchrun`` trial; returns ``torchrun_pause_s``."""
    out = Path(tempfile.mkdtemp(prefix="torchrun-", dir=workdir))
    log = StepLog(out / "steps.log")
    tag = uuid.uuid4().hex
    cmd = torchrun_command(_free_port(), tag[:8], out)
    env = _env(**{MARK: tag, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    agents: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def agent() -> None:
        output = (out / f"agent{len(agents)}.log").open("wb")
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        agents.append((proc, output))

    def alive(check: Callable[[], Any]) -> Callable[[], Any]:
        def probe() -> Any:
            for i, (proc, _) in enumerate(agents):
                if proc.poll() is not None:
                    tail = (out / f"agent{i}.log").read_text(errors="replace")[-2000:]
                    raise SystemExit(f"benchmark failed: torchrun agent {i} exited:\n{tail}")
            return check()

        return probe

    try:
        began = time.time()
        agent()
        agent()
        _wait(alive(lambda: log.count("rank:0", 2) >= WARM_STEPS), "torchrun steps at 2")
        start_s = float(log.first_at(2) or 0.0) - began
        asked = time.time()
        agent()
        agent()
        at4 = float(_wait(alive(lambda: log.first_at(4)), "torchrun step at world size 4"))
    finally:
        _kill_marked(tag)
        for proc, output in agents:
            proc.wait()
            output.close()
    pause = at4 - asked
    trials.add(
        verbose,
        "torchrun",
        torchrun_start_s=start_s,
        torchrun_pause_s=pause,
        torchrun_steps_gained=log.gained("rank:0", asked),
    )
    trials.phases("torchrun", phases(out, asked, at4, None))
    return pause


# Records under resizes and kills ------------------------------------------------------


def records_run(workdir: Path, verbose: bool) -> tuple[int, int, float]:
    """``(lost, duplicated, seconds)`` over a run of two grows, shrinks and kills."""
    out = Path(tempfile.mkdtemp(prefix="records-", dir=workdir))
    allow = out / "allow"

    def lines() -> int:
        log = out / "steps.log"
        return len(log.read_text().splitlines()) if log.exists() else 0

    def steps_of(task: str) -> int:
        log = out / "steps.log"
        text = log.read_text() if log.exists() else ""
        return sum(1 for line in text.splitlines() if line.startswith(f"{task} "))

    def advance(steps: int) -> None:
        """Lets the run take ``steps`` more logged steps and waits for them."""
        target = lines() + steps
        allow.write_text(str(target))
        _wait(lambda: lines() >= target, f"{target} logged steps")

    def say(what: str) -> None:
        if verbose:
            print(f"  records run: {what}", flush=True)

    def lost(cluster: Cluster, task: str) -> None:
        os.kill(cluster.job_pid(task), signal.SIGKILL)
        _wait(
            lambda: any(
                m.get("task") == task and m.get("change") == "lost"
                for m in cluster.state().get("membership") or []
            ),
            f"{task} lost",
        )
        say(f"killed {task}: it left")

    allow.write_text("30")
    began = time.time()
    with Cluster(
        workdir / "home",
        out,
        ["--chief", "--ps", "1", "--workers", "2:4", "--max-restarts", "0"],
        "records",
    ).stopped() as cluster:
        _wait(lambda: lines() >= 30, "30 steps at 2 workers")
        for victim in ("newcomer", "worker:1"):
            said = cluster.scale(4)
            say(said)
            grown = added(said)
            advance(30)
            _wait(lambda g=grown: all(steps_of(t) for t in g), f"steps of {', '.join(grown)}")
            lost(cluster, grown[-1] if victim == "newcomer" else victim)
            advance(30)
            say(cluster.scale(2))
            advance(30)
        allow.unlink()
        from clusterflow.manager.registry import TERMINAL

        _wait(lambda: cluster.state().get("status") in TERMINAL, "the records run's end")
        state = cluster.state()
        if state.get("status") != "succeeded":
            raise SystemExit(f"benchmark failed: the records run {state.get('summary')}")
    final = json.loads((out / "final.json").read_text())
    epochs = final["epochs"]
    missing = sum(max(0, epochs - round(c)) for c in final["counts"])
    extra = sum(max(0, round(c) - epochs) for c in final["counts"])
    return missing, extra, time.time() - began


def added(said: str) -> list[str]:
    """The workers ``clusterflow scale`` says it added: ``... (added worker:2, worker:3)``."""
    match = re.search(r"added ([^;)]+)", said)
    if not match:
        raise SystemExit(f"benchmark failed: scale added no worker: {said}")
    return [task.strip() for task in match.group(1).split(",")]


# ---------------------------------------------------------------------------------------


def main() -> None:
    args = parser("elastic", __doc__).parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    one_thread_per_process()
    with tempfile.TemporaryDirectory(prefix="cf-elastic-") as tmp:
        workdir = Path(tmp)

        def ours(proc: psutil.Process) -> bool:
            env = proc.environ()
            return env.get("CLUSTERFLOW_HOME", "").startswith(tmp) or MARK in env

        load = MachineLoad(ours)
        # Warm the page cache for torch's and clusterflow's files: no side's first trial
        # pays for reading them from disk.
        subprocess.run(
            [sys.executable, "-c", "import torch, clusterflow.strategies, clusterflow.data"],
            env=_env(),
            check=True,
        )
        s = TORCHRUN_SETTINGS
        print(
            f"torchrun: --nnodes 2:4 --nproc-per-node 1, c10d rendezvous, "
            f"--monitor-interval {s['monitor_interval']}, --rdzv-conf "
            f"join_timeout={s['join_timeout']},last_call_timeout={s['last_call_timeout']},"
            f"close_timeout={s['close_timeout']}, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            flush=True,
        )
        trials = Trials()
        v = args.verbose
        try:
            times = alternate(
                {
                    "ours": lambda: grow(workdir, trials, v),
                    "torchrun": lambda: torchrun(workdir, trials, v),
                    "fresh": lambda: fresh(workdir, trials, v),
                },
                rounds,
                verbose=v,
                # A trial is a whole start; the page cache is warm. --quick skips the
                # untimed trial of each side that a full run takes first.
                warmup=not args.quick,
            )
            lost, duplicated, seconds = records_run(workdir, v)
        finally:
            home = workdir / "home"
            for cluster in (home / "clusters").glob("*") if home.exists() else ():
                subprocess.run(
                    [*CLI, "stop", cluster.name, "--grace", "2"],
                    env=_env(CLUSTERFLOW_HOME=str(home)),
                    capture_output=True,
                    check=False,
                )
        described = load.describe()
    grown_rate = trials.last("grown_steps_per_s", rounds)
    fresh_rate = trials.last("fresh_steps_per_s", rounds)
    raw = {
        "pause_s": Spread.of(times["ours"]),
        "torchrun_pause_s": Spread.of(times["torchrun"]),
        "fresh_start_s": Spread.of(times["fresh"]),
        "start_s": Spread.of(trials.last("start_s", rounds)),
        "torchrun_start_s": Spread.of(trials.last("torchrun_start_s", rounds)),
        "steps_gained": Spread.of(trials.last("steps_gained", rounds)),
        "torchrun_steps_gained": Spread.of(trials.last("torchrun_steps_gained", rounds)),
        "grown_steps_per_s": Spread.of(grown_rate),
        "fresh_steps_per_s": Spread.of(fresh_rate),
    }
    for name, spread in raw.items():
        print(f"{name}: {spread}")
    if args.verbose:
        for side, what in (
            ("ours", "the grow's pause"),
            ("torchrun", "torchrun's pause"),
            ("fresh", "a fresh start"),
        ):
            print(f"where {what} went, seconds: {trials.where(side, rounds)}")
    print(
        f"records run (2 grows, 2 shrinks, 2 kills) in {seconds:.0f} s: "
        f"{lost} record applications lost, {duplicated} duplicated",
        flush=True,
    )
    print(described)
    one, five, fifteen = os.getloadavg()
    print(f"load average (uptime): {one:.2f}, {five:.2f}, {fifteen:.2f}", flush=True)
    result(
        "elastic",
        pause_vs_torchrun=ratio(times["ours"], times["torchrun"]),
        pause_vs_fresh=ratio(times["ours"], times["fresh"]),
        grown_vs_fresh=ratio(grown_rate, fresh_rate),
        records_lost=lost,
        records_duplicated=duplicated,
        **raw,
    )


if __name__ == "__main__":
    main()
