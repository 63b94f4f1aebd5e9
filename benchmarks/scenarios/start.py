"""Partitions under ``clusterflow start``: a real cluster whose tasks run in emulated hosts.

Six hosts (``EmulatedHosts``): the manager (with the data dispatcher and the torch store)
on host 0, ``ps:0`` on 1, ``chief:0`` on 2, ``worker:0`` on 3, ``worker:1`` on 4, and the
warm standby on 5 (``clusterflow.testing.hosts_backend``: ``clusterflow start --backend
hosts``, every task binding its host's address, curve auth). The job is the counter model
through ``fit()``: one counter per record, SGD at lr 1 and a gradient of -1 at
``counts[id]``, async parameter servers, the data service and a ``Checkpoint`` hook, so a
record applied twice counts 2 and a lost one 0.

One run, the cuts in turn (``SCENARIOS``), each lasting until the manager has acted:

* ``worker_ps``: ``worker:0``'s host from ``ps:0``'s, longer than the workers' ps
  deadline. Its next ps call raises ``DeadlineExceeded`` and the job exits; the manager
  respawns it (on the standby's host) and gives its leases back; healed once the
  replacement trained.
* ``worker_manager``: host 4 (``worker:1``) from the manager's host. Its supervisor
  misses heartbeats for ``CLUSTERFLOW_MANAGER_TIMEOUT`` and stops its job; the manager
  respawns ``worker:1`` (on the standby's host) and gives its leases back; healed once
  the replacement trained.
* ``ps_manager``: host 1 (``ps:0``) from the manager's host. Its supervisor stops the ps
  the same way; the manager restarts every task from the last checkpoint; the new ps
  sits at the registration barrier until the link heals, then the run resumes.

The run must end ``succeeded`` with every counter at the number of epochs. Figures: per
cut, the time from the cut to the cut-off task's exit (it sat without progress or
failure that long) against the bound docs/failure-semantics.md gives.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterflow.testing.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 3000
EPOCHS = 1
SPLIT = 10
CHECKPOINT_EVERY = 3
STEP_S = 0.2
"""A step's compute, emulated (a sleep) until the cuts are done: the run outlasts every
cut (``RECORDS`` at this pace take far longer than the cuts), then trains its remaining
records at full speed (``CUTS_DONE``) instead of sleeping through them."""
CUTS_DONE = "cuts.done"
"""The file (in the job's ``OUT``) that ``run`` writes once its last cut healed."""
CUTS = {
    "worker_ps": ("worker:0", "ps:0", "task_respawned"),
    "worker_manager": ("worker:1", "manager", "task_respawned"),
    "ps_manager": ("ps:0", "manager", "cluster_restarted"),
}
"""Each scenario: the task whose host is cut, from whose host, and the manager's answer."""
SCENARIOS = tuple(CUTS)
HOSTS = {"manager": 0, "ps:0": 1, "chief:0": 2, "worker:0": 3, "worker:1": 4, "spare": 5}
MANAGER_TIMEOUT_S = 3.0
"""``CLUSTERFLOW_MANAGER_TIMEOUT`` of the supervisors (15 s by default)."""
HEARTBEAT_TIMEOUT_S = 6.0
"""The manager's heartbeat deadline (30 s by default); as by default, twice the above."""
HEARTBEAT_ROUND_S = 1.0 + 2.0
"""A supervisor's heartbeat interval and its call's deadline (``max(2, 2 * interval)``)."""
SUPERVISOR_GRACE_S = 10.0
"""From the supervisor's SIGTERM to its SIGKILL (``supervisor.GRACE_S``)."""
EXIT_MARGIN_S = 5.0
"""From the signal to the exit the manager reads (interpreter teardown, its poll)."""
STALL_BOUND_S = MANAGER_TIMEOUT_S + HEARTBEAT_ROUND_S + SUPERVISOR_GRACE_S + EXIT_MARGIN_S
PS_DEADLINE_S = 10.0
"""The workers' ps deadline (``ParameterServerStrategy(deadline_s=...)``, 120 s by default)."""
PS_STALL_BOUND_S = PS_DEADLINE_S + EXIT_MARGIN_S
TIMEOUT_S = 240.0


@dataclass(frozen=True, slots=True)
class Cut:
    """What one cut did."""

    scenario: str
    task: str
    """The task cut off from the manager."""
    stall_s: float
    """From the cut to that task's exit as the manager recorded it."""
    stall_bound_s: float
    ended_before_heal: bool
    """The cut-off task ended while the link was still cut: it did not hang on it."""
    recovery: str
    """The manager's answer: ``task_respawned`` or ``cluster_restarted``."""


@dataclass(slots=True)
class Run:
    """The whole run under cuts."""

    status: str = ""
    cuts: list[Cut] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    spec: dict[str, list[str]] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    """Each placed task's (and the manager's) host address."""
    manager: str = ""
    """The address the manager served at (state.json)."""
    output: str = ""


def _wait(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    return wait_for(predicate, what, timeout, poll_s=0.1)


class _Cluster:
    def __init__(self, home: Path, out: Path) -> None:
        self.home, self.out = home, out
        self.id = ""

    @property
    def path(self) -> Path:
        return self.home / "clusters" / self.id

    def events(self) -> list[dict[str, Any]]:
        path = self.path / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def event(self, kind: str, task: str, after: float) -> dict[str, Any] | None:
        return next(
            (
                e
                for e in self.events()
                if e["event"] == kind and e.get("task") == task and e["time"] >= after
            ),
            None,
        )

    def state(self) -> dict[str, Any]:
        path = self.path / "state.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def ended(self) -> bool:
        return self.state().get("status") in ("succeeded", "failed", "stopped")

    def steps(self, after: float = 0.0) -> int:
        path = self.out / "steps.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return sum(1 for line in lines if float(line.split()[0]) >= after)


def run(workdir: Path, scenarios: tuple[str, ...] = SCENARIOS) -> Run:
    """One cluster under ``clusterflow start --backend hosts``, cut as ``scenarios`` say."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from clusterflow.rpc import Credentials  # noqa: F401  (fails early without the extras)
    from clusterflow.testing import EmulatedHosts
    from clusterflow.testing.hosts_backend import ENV_HOSTS, Placement

    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenario {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    out, home = workdir / "out", workdir / "home"
    out.mkdir(parents=True, exist_ok=True)
    records = out / "records.parquet"
    pq.write_table(pa.table({"id": pa.array(range(RECORDS), pa.int64())}), records)
    result = Run()
    with EmulatedHosts(len(HOSTS), prefix="place") as hosts:
        placement = Placement.of(
            hosts,
            manager=HOSTS["manager"],
            tasks={t: i for t, i in HOSTS.items() if ":" in t},
            spare=HOSTS["spare"],
            limits={"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S},
        )
        result.addresses = {t: hosts[i].address for t, i in HOSTS.items()}
        env = {
            **os.environ,
            "CLUSTERFLOW_HOME": str(home),
            ENV_HOSTS: str(placement.write(workdir / "placement.json")),
            "CLUSTERFLOW_MANAGER_TIMEOUT": str(MANAGER_TIMEOUT_S),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        job = [sys.executable, "-m", "benchmarks.scenarios.start", str(out), str(records)]
        started = subprocess.run(
            placement.manager_argv(
                [sys.executable, "-m", "clusterflow.cli.main", "start", "--detach",
                 "--backend", "hosts", "--chief", "--ps", "1", "--workers", "2",
                 "--max-restarts", "6", "--", *job]
            ),
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if started.returncode != 0:
            raise RuntimeError(f"clusterflow start failed: {started.stderr.strip()[-500:]}")
        cluster = _Cluster(home, out)
        cluster.id = started.stdout.strip().splitlines()[-1]
        try:
            _wait(lambda: cluster.steps() >= 6 or cluster.ended(), "training steps")
            state = cluster.state()
            result.spec = dict(state.get("spec") or {})
            result.manager = str((state.get("manager") or {}).get("address", ""))
            for scenario in scenarios:
                cut = _cut(hosts, cluster, scenario)
                if cut is None:
                    break  # the run ended first: the caller sees fewer cuts than asked
                result.cuts.append(cut)
            # Nothing is cut any more: the rest of the records need no emulated compute.
            (out / CUTS_DONE).touch()
            _wait(cluster.ended, "the end of the run")
        finally:
            if not cluster.ended():
                # If it does not answer in time, closing the hosts kills it (and its tasks).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(  # from the manager's host: only there is it reachable
                        placement.manager_argv(
                            [sys.executable, "-m", "clusterflow.cli.main", "stop", cluster.id]
                        ),
                        env=env, cwd=ROOT, capture_output=True, timeout=60, check=False,
                    )  # fmt: skip
            result.status = cluster.state().get("status", "")
            log = cluster.path / "output.log"
            result.output = log.read_text()[-200_000:] if log.exists() else ""
    final = out / "final.json"
    if final.exists():
        counts = json.loads(final.read_text())
        result.lost = sum(1 for c in counts if round(c) < EPOCHS)
        result.duplicated = sum(1 for c in counts if round(c) > EPOCHS)
    else:
        result.lost = RECORDS  # nothing came back: count it all lost, never as a success
    return result


def _host_of(hosts: Any, cluster: _Cluster, task: str) -> int:
    """The host ``task`` runs on now (a respawn may have moved it to the spare host)."""
    job, index = task.split(":")
    address = (cluster.state().get("spec") or {})[job][int(index)].rsplit(":", 1)[0]
    return next(h.index for h in hosts.hosts if h.address == address)


def _cut(hosts: Any, cluster: _Cluster, scenario: str) -> Cut | None:
    """Cuts a task's host from its peer's until the manager has acted, then heals."""
    task, peer, recovery = CUTS[scenario]
    since = time.time()  # a checkpoint's worth of progress since the last recovery
    _wait(
        lambda: cluster.steps(since) >= 2 * CHECKPOINT_EVERY or cluster.ended(),
        f"progress before {scenario}",
    )
    if cluster.ended():
        return None
    far = _host_of(hosts, cluster, task)
    near = HOSTS["manager"] if peer == "manager" else _host_of(hosts, cluster, peer)
    cut_at = time.time()
    hosts.cut(far, near)
    try:
        _wait(lambda: cluster.event(recovery, task, cut_at), f"{recovery} of {task}")
        if recovery == "task_respawned":
            # The run goes on without the cut-off host: the replacement trains.
            respawned = cluster.event(recovery, task, cut_at)
            assert respawned is not None
            _wait(lambda: cluster.steps(respawned["time"]) >= 3, "progress after the respawn")
        healed_at = time.time()
    finally:
        hosts.heal(far, near)
    exited = cluster.event("task_exited", task, cut_at)
    stall = (exited["time"] if exited else healed_at) - cut_at
    if recovery == "cluster_restarted":
        # Healed, the restarted ps registers and the run resumes.
        _wait(lambda: cluster.steps(healed_at) >= 3 or cluster.ended(), "progress after heal")
    return Cut(
        scenario=scenario,
        task=task,
        stall_s=round(stall, 2),
        stall_bound_s=PS_STALL_BOUND_S if peer.startswith("ps") else STALL_BOUND_S,
        ended_before_heal=exited is not None and exited["time"] <= healed_at,
        recovery=recovery,
    )


# The job (python -m benchmarks.scenarios.start OUT RECORDS), one per task ------------------


def _job(out: Path, path: str) -> None:
    import torch
    from torch import nn

    import clusterflow
    from clusterflow.data import distributed_dataset
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    from clusterflow.train import Checkpoint, Hook

    torch.set_num_threads(1)
    cuts_done = out / CUTS_DONE

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.counts = nn.Parameter(torch.zeros(RECORDS))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if not cuts_done.exists():
                time.sleep(STEP_S)  # a step's compute (emulated: no CPU)
            return self.counts[ids]

    strategy = ParameterServerStrategy(mode="async", deadline_s=PS_DEADLINE_S)
    with strategy.scope():
        model = Counter()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = distributed_dataset(
        path,
        batch_size=SPLIT,
        split_size=SPLIT,
        seed=7,
        epochs=EPOCHS,
        wait_for_all_acks=True,
        collate_fn=lambda cols: (torch.as_tensor(cols["id"]), torch.as_tensor(cols["id"])),
    )

    class Logged(Hook):
        def after_step(self, session: Any, info: Any) -> None:
            fd = os.open(out / "steps.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{time.time():.3f} {os.environ['CLUSTERFLOW_TASK']}\n".encode())
            finally:
                os.close(fd)

    clusterflow.fit(
        model,
        lambda outputs, _ids: -outputs.sum(),
        opt,
        data,
        strategy=strategy,
        epochs=EPOCHS,
        hooks=[Checkpoint(every_steps=CHECKPOINT_EVERY), Logged()],
    )
    data.close()
    if strategy.is_chief:
        (out / "final.json").write_text(json.dumps(model.counts.detach().tolist()))
    strategy.close()


if __name__ == "__main__":
    _job(Path(sys.argv[1]), sys.argv[2])
