"""Partition scenarios on emulated hosts: a worker cut off from its ps and its dispatcher.

Three hosts (``EmulatedHosts``): host 0 serves ps task 0 and the data dispatcher (one
``Server``, as a chief hosts the dispatcher in manual mode), hosts 1 and 2 run launches
of the task ``worker:0``. The job is the chaos suite's counter model: one counter per
record, SGD at lr 1 and a gradient of -1 at ``counts[id]``, so a record applied twice
counts 2 and a lost one 0. This process plays the manager: it cuts links, declares the
task dead, relaunches it (a higher ``CLUSTERFLOW_INCARNATION``), and heals.

Scenarios (``SCENARIOS``):

* ``cut_beyond_deadline``: worker 0's link is cut for longer than its ps deadline. The
  worker's ps call raises ``DeadlineExceeded`` within the deadline and the process
  exits; the "manager" hands its leases back and relaunches it on host 2 after the
  link heals; the run completes.
* ``zombie_heals_after_replacement``: the deadline is longer than the cut, so the cut
  off worker is still alive, blocked in a push, when the "manager" declares it dead and
  relaunches it on host 2, raising its fence at the dispatcher and at the ps
  (``ps.fence``, as ``manager/fences.py`` does) before the replacement starts. The link
  heals after the replacement trained. The old process's clients find their
  connection back (the cut killed the old one, and its request with it) and ask
  ``ps.fence``/``data.fence``: refused, the old process stops itself with
  ``TaskFenced``. The ps and the dispatcher count what they served of each launch
  (``FenceBook.counts``): nothing of the old one after its fence was raised.

Either way every record's counter must end at exactly the number of epochs. Progress
and outcomes travel through files in a shared folder (the hosts share this machine's
filesystem, not its network).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterflow.testing.netns import EmulatedHosts
from clusterflow.testing.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
"""The repository: the hosts' processes run ``python -m benchmarks.scenarios.partition``."""
RECORDS = 240
EPOCHS = 1
SPLIT = 10
PS_PORT = 7400
SCENARIOS = ("cut_beyond_deadline", "zombie_heals_after_replacement")
TIMEOUT_S = 180.0
EXIT_MARGIN_S = 10.0
"""From a raised error to the process's end (closing clients, its interpreter's exit)."""
FENCED_WITHIN_S = 5.0
"""From the heal to a zombie's ``TaskFenced``: ZeroMQ re-dials (at most every second),
then one round trip of ``<service>.fence``; docs/failure-semantics.md, "Fencing"."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one scenario ended with."""

    scenario: str
    lost: int
    """Records whose counter ended below the number of epochs."""
    duplicated: int
    """Records whose counter ended above it."""
    stall_s: float
    """From the cut to the cut-off worker's exit or its fencing: the longest a task sat
    without progress or failure."""
    stall_bound_s: float
    """What docs/failure-semantics.md promises for that wait."""
    first_exit: str
    """How the cut-off launch ended: its last line."""
    fenced: bool
    """It ended by ``TaskFenced`` (it learnt it was replaced), not by a deadline."""
    served_after_fence: int = 0
    """Requests of the cut-off launch the ps or the dispatcher served after its fence
    was raised (the relaunch). Goal 0."""
    refused: int = 0
    """Its requests (and probes) the ps and the dispatcher refused."""
    ended_after_heal_s: float = 0.0
    """From the heal to its exit (the zombie scenario)."""


def _env(workdir: Path, hosts: EmulatedHosts, incarnation: int, host: int) -> dict[str, str]:
    ps = f"{hosts[0].address}:{PS_PORT}"
    spec = {"ps": [ps], "worker": [f"{hosts[host].address}:7500"]}
    env = {
        **os.environ,
        "TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": "worker", "index": 0}}),
        "CLUSTERFLOW_SECRET": (workdir / "secret").read_text().strip(),
        "CLUSTERFLOW_DISPATCHER": ps,
        "CLUSTERFLOW_TASK": "worker:0",
        "CLUSTERFLOW_INCARNATION": str(incarnation),
        "OMP_NUM_THREADS": "1",
    }
    for name in ("CLUSTERFLOW_MANAGER", "CLUSTERFLOW_SECRET_FILE", "CLUSTERFLOW_AUTH"):
        env.pop(name, None)
    return env


def _progress(workdir: Path) -> list[str]:
    path = workdir / "steps.log"
    return path.read_text().splitlines() if path.exists() else []


def _wait(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S) -> Any:
    return wait_for(predicate, what, timeout, poll_s=0.05)


def run(scenario: str, workdir: Path, *, cut_s: float = 14.0, prefix: str = "hostile") -> Outcome:
    """Runs one scenario on three fresh emulated hosts; ``workdir`` must be empty.

    ``prefix`` names the hosts' network namespaces (``EmulatedHosts``)."""
    from clusterflow.rpc import Credentials

    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    workdir.mkdir(parents=True, exist_ok=True)
    Credentials.generate().to_file(workdir / "secret")
    zombie = scenario == "zombie_heals_after_replacement"
    # The cut-off launch's ps deadline: shorter than the cut (it gives up and exits), or
    # longer (it outlives the cut: a zombie once healed).
    deadline_s = 60.0 if zombie else 10.0
    me = [sys.executable, "-m", "benchmarks.scenarios.partition"]
    with EmulatedHosts(3, prefix=prefix) as hosts:
        serve = hosts[0].popen(
            [*me, "serve", str(workdir), f"{hosts[0].address}:{PS_PORT}"],
            env=_env(workdir, hosts, 0, 0),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(workdir / "serve.err", "w"),  # noqa: SIM115 (the process keeps it)
        )
        _wait((workdir / "serving").exists, "ps serving")
        first = hosts[1].popen(
            [*me, "work", str(workdir), str(deadline_s)],
            env=_env(workdir, hosts, 0, 1),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(workdir / "first.err", "w"),  # noqa: SIM115
        )
        _wait(lambda: len(_progress(workdir)) >= 5, "progress of the first launch")
        hosts.cut(1)
        cut_at = time.monotonic()
        if zombie:
            # The "manager" declares it dead (it stopped answering) and relaunches it.
            time.sleep(cut_s / 2)
            _release(hosts, workdir, "worker:0", 1)
            second = hosts[2].popen(
                [*me, "work", str(workdir), "60"],
                env=_env(workdir, hosts, 1, 2),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=open(workdir / "second.err", "w"),  # noqa: SIM115
            )
            done = len(_progress(workdir))
            _wait(lambda: len(_progress(workdir)) >= done + 3, "progress of the replacement")
            time.sleep(max(0.0, cut_s - (time.monotonic() - cut_at)))
            hosts.heal(1)
            healed_at = time.monotonic()
            if os.environ.get("HOSTILE_DEBUG"):
                time.sleep(15)
                first.send_signal(signal.SIGUSR1)
            code = first.wait(TIMEOUT_S)
            stall = time.monotonic() - cut_at
            ended_after_heal = time.monotonic() - healed_at
            # Healed, its clients find their connection back and ask whether it was
            # fenced (a request in flight when the link broke died with the connection):
            # refused, it stops. The bound: the cut, the re-dial and that answer, its exit.
            bound = (healed_at - cut_at) + FENCED_WITHIN_S + EXIT_MARGIN_S
        else:
            ended_after_heal = 0.0
            code = first.wait(TIMEOUT_S)
            stall = time.monotonic() - cut_at
            # Its ps deadline (its data client's is set to the same), then its exit.
            bound = deadline_s + EXIT_MARGIN_S
            time.sleep(max(0.0, cut_s - stall))
            hosts.heal(1)
            _release(hosts, workdir, "worker:0", 1)
            second = hosts[2].popen(
                [*me, "work", str(workdir), "60"],
                env=_env(workdir, hosts, 1, 2),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=open(workdir / "second.err", "w"),  # noqa: SIM115
            )
        if second.wait(TIMEOUT_S) != 0:
            raise RuntimeError(
                f"{scenario}: the replacement failed: {_tail(workdir / 'second.err')}"
            )
        serve.terminate()
        serve.wait(30)
    counts = json.loads((workdir / "final.json").read_text())
    lost = sum(1 for c in counts if round(c) < EPOCHS)
    duplicated = sum(1 for c in counts if round(c) > EPOCHS)
    last = _tail(workdir / "first.err")
    if code == 0:
        raise RuntimeError(f"{scenario}: the cut-off launch ended normally: {last}")
    served, refused = _fence_counts(workdir)
    return Outcome(
        scenario,
        lost,
        duplicated,
        round(stall, 2),
        round(bound, 2),
        last,
        "TaskFenced" in last,
        served,
        refused,
        round(ended_after_heal, 2),
    )


def _fence_counts(workdir: Path) -> tuple[int, int]:
    """Requests of launch 0 served after its fence was raised, and those refused, over
    the ps and the dispatcher (what ``serve`` recorded at the relaunch and at its end)."""
    at_fence = json.loads((workdir / "fences_at_relaunch.json").read_text())
    final = json.loads((workdir / "fences.json").read_text())
    served = sum(
        final[s]["admitted"].get("0", 0) - at_fence[s]["admitted"].get("0", 0) for s in final
    )
    return served, sum(final[s]["refused"].get("0", 0) for s in final)


def _tail(path: Path) -> str:
    lines = (
        [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
    return lines[-1] if lines else ""


def _release(hosts: EmulatedHosts, workdir: Path, task: str, incarnation: int) -> None:
    """The manager's part of a relaunch: the old launch's leases back, its fence raised."""
    done = hosts[0].run(
        [sys.executable, "-m", "benchmarks.scenarios.partition", "relaunch", str(workdir),
         f"{hosts[0].address}:{PS_PORT}", task, str(incarnation)],
        env=_env(workdir, hosts, 0, 0),
        cwd=ROOT,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"relaunch of {task} failed: {done.stderr.strip()[-300:]}")


# The processes (python -m benchmarks.scenarios.partition ROLE ...) --------------------


def _serve(workdir: Path, address: str) -> None:
    import signal
    import threading

    from clusterflow.data.dispatcher import DispatcherService
    from clusterflow.ps.service import PSService
    from clusterflow.rpc import Credentials, Request
    from clusterflow.server import Server

    creds = Credentials.from_hex((workdir / "secret").read_text())
    server = Server({"ps": [address]}, "ps", 0, credentials=creds, start=False)
    ps = PSService(server)
    data = DispatcherService().register_on(server)

    def relaunched(request: Request) -> int:
        task, incarnation = request.body["task"], int(request.body["incarnation"])
        data.fences.raise_to(task, incarnation)  # the manager's dispatcher, in process
        return data.release_worker(task)

    def fences(path: Path) -> None:
        counts = {"ps": ps.fences.counts("worker:0"), "data": data.fences.counts("worker:0")}
        path.write_text(json.dumps(counts))

    server.register("test.relaunched", relaunched)
    server.register("test.fences", lambda r: fences(workdir / "fences_at_relaunch.json"))
    server.start()
    (workdir / "serving").touch()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop()
    fences(workdir / "fences.json")


def _relaunch(workdir: Path, address: str, task: str, incarnation: int) -> None:
    from clusterflow.rpc import Credentials, RpcClient
    from clusterflow.rpc.fencing import Fence, announce

    creds = Credentials.from_hex((workdir / "secret").read_text())
    with RpcClient(address, creds, deadline=20) as client:
        client.call("test.relaunched", {"task": task, "incarnation": incarnation})
        # The ps hears of it as from the manager (manager/fences.py), before the launch.
        missed = announce([address], creds, Fence(task, incarnation))
        if missed:
            raise RuntimeError(f"the ps did not take the fence: {missed}")
        client.call("test.fences")  # what each launch got served so far


def _work(workdir: Path, deadline_s: float) -> None:
    import faulthandler
    import signal

    import torch

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand, to stderr

    from clusterflow.data import distributed_dataset
    from clusterflow.strategies.parameter_server import ParameterServerStrategy
    from clusterflow.train import TrainingSession

    torch.set_num_threads(1)
    strategy = ParameterServerStrategy(mode="async", deadline_s=deadline_s)
    with strategy.scope():
        counts = torch.nn.Parameter(torch.zeros(RECORDS))
        model = torch.nn.ParameterList([counts])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = distributed_dataset(
        {"id": torch.arange(RECORDS)},
        batch_size=SPLIT,
        split_size=SPLIT,
        seed=3,
        epochs=EPOCHS,
        wait_for_all_acks=True,
        worker="worker:0",
    )
    data.dispatcher.rpc.deadline = deadline_s  # a zombie's calls outlive the cut

    def add_one(ids: torch.Tensor) -> None:
        opt.zero_grad()
        (-counts[ids].sum()).backward()  # type: ignore[no-untyped-call]  # counts[ids] += 1
        opt.step()

    log = workdir / "steps.log"
    with TrainingSession(strategy=strategy, model=model, data=data, report_figures=False) as s:
        for item in data:
            time.sleep(0.05)  # a step's compute
            s.run_step(add_one, item.data["id"], completes=item)
            with open(log, "a") as f:
                f.write(f"{os.environ['CLUSTERFLOW_INCARNATION']} {item.keys}\n")
    data.close()
    strategy.pull_values()
    (workdir / "final.json").write_text(json.dumps(counts.detach().tolist()))
    strategy.close()


def main(argv: list[str]) -> None:
    role, workdir = argv[0], Path(argv[1])
    if role == "serve":
        _serve(workdir, argv[2])
    elif role == "relaunch":
        _relaunch(workdir, argv[2], argv[3], int(argv[4]))
    elif role == "work":
        _work(workdir, float(argv[2]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
